"""Evaluation prompts: MT-bench (80 questions, 2 turns each, 8 categories), or any chat data file.

A conversation is a list of user turns. Turn j is asked, through the target's chat template, after the
model's own answers to turns 0..j-1 (MT-bench's protocol). Records read:
    {"turns": [str, ...], "category": ...[, "system": str]} MT-bench questions
    {"conversations": [...]} / {"messages": [...]}          ShareGPT / OpenAI chats: their user turns
                                                            (and a leading system message)
    {"prompt" | "instruction" | "question" | "text": str}   one turn
A chat with images (data/images.py's places) keeps its user turns' image parts; its prompts are then made
by the target's processor, each image expanded as the processor expands it (`prompt_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from spec_cli import assets
from spec_cli.data import records
from spec_cli.errors import DataError

SINGLE_TURN_KEYS = ("prompt", "instruction", "question", "text")


@dataclass
class Conversation:
    id: str
    turns: list  # user turns, asked in order: text, or OpenAI parts with {"type": "image"} where images go
    category: str | None = None
    system: str | None = None
    answers: list[str] = field(default_factory=list)  # the model's, filled in as they are generated
    images: list[str] = field(default_factory=list)  # the sources of the turns' images, in order
    base: Path | None = None  # the folder relative image paths start from

    def messages(self, turn: int) -> list[dict]:
        """The chat up to user turn `turn`, with the model's earlier answers."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for j in range(turn):
            out += [
                {"role": "user", "content": self.turns[j]},
                {"role": "assistant", "content": self.answers[j]},
            ]
        return out + [{"role": "user", "content": self.turns[turn]}]


def _user_turns(record: dict) -> tuple[list[str], str | None]:
    """(user turns, system prompt) of one record."""
    if isinstance(
        record.get("turns"), list
    ):  # MT-bench; spec train's held-out prompts add a "system"
        system = record.get("system")
        return (
            [t for t in record["turns"] if isinstance(t, str) and t.strip()],
            system if isinstance(system, str) and system.strip() else None,
        )
    chat = (
        record.get("conversations")
        if record.get("conversations") is not None
        else record.get("messages")
    )
    if isinstance(chat, list):
        turns, system = [], None
        for i, turn in enumerate(chat):
            if not isinstance(turn, dict):
                continue
            role = records.ROLES.get(str(turn.get("role", turn.get("from", ""))).strip().lower())
            text = records._content_text(turn.get("content", turn.get("value")))
            if not text or not text.strip():
                continue
            if role == "user":
                turns.append(text)
            elif role == "system" and i == 0:
                system = text
        return turns, system
    for key in SINGLE_TURN_KEYS:
        if isinstance(record.get(key), str) and record[key].strip():
            return [record[key]], None
    return [], None


def _image_turns(record: dict) -> tuple[list, str | None, list[str]]:
    """(user turns with their image parts, system prompt, image sources) of an image-text record."""
    from spec_cli.data import vlm
    from spec_cli.data.images import image_refs

    kind, messages = vlm.image_chat(record)
    if kind == "skip":
        return [], None, []
    turns = [m["content"] for m in messages if m["role"] == "user"]
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    return turns, system, [ref.source for ref in image_refs(record)]


def load_conversations(prompts: str, num_prompts: int | None = None) -> list[Conversation]:
    """`mt-bench`, `sharegpt` (both built in) or a chat data file -> conversations. With `num_prompts`,
    that many are taken round-robin over the categories (so a few prompts still cover them), in file order."""
    path = assets.resolve_data_arg(prompts)  # `mt-bench` / `sharegpt` name the built-in files
    found = []
    base = Path(path) if Path(path).is_dir() else Path(path).parent
    for i, record in enumerate(records.load_records(path)):
        sources = []
        if records.has_images(record):
            turns, system, sources = _image_turns(record)
        else:
            turns, system = _user_turns(record)
        if turns:
            category = record.get("category")
            found.append(
                Conversation(
                    id=str(record.get("question_id", record.get("id", i))),
                    turns=turns,
                    category=str(category) if category else None,
                    system=system,
                    images=sources,
                    base=base,
                )
            )
    if not found:
        raise DataError(
            f"no user turns found in {prompts}",
            "each record needs `turns`, `conversations`/`messages` with user turns, or `prompt`",
        )
    if num_prompts is None or num_prompts >= len(found):
        return found
    by_category: dict[str | None, list[int]] = {}
    for i, conv in enumerate(found):
        by_category.setdefault(conv.category, []).append(i)
    queues, chosen = list(by_category.values()), []
    while len(chosen) < num_prompts:
        for queue in queues:
            if queue and len(chosen) < num_prompts:
                chosen.append(queue.pop(0))
    return [found[i] for i in sorted(chosen)]


def prompt_ids(tokenizer, conv: Conversation, turn: int, processor=None) -> list[int]:
    """Token ids of the chat up to user turn `turn`, ending with the assistant's generation prompt (an
    data.vlm.ImagePrompt when the chat has images: made by the target's `processor`)."""
    messages = conv.messages(turn)
    if conv.images:
        return _image_prompt(tokenizer, processor, conv, messages)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    # no chat template (a base model): the turns as plain text, one paragraph each
    text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return tokenizer(text)["input_ids"]


def _image_prompt(tokenizer, processor, conv: Conversation, messages: list[dict]):
    from spec_cli.data import vlm
    from spec_cli.data.images import open_image

    if processor is None:
        raise DataError(
            f"prompt {conv.id!r} has images, and the target folder has no processor",
            "evaluate a vision-language target saved with its processor (preprocessor_config.json), "
            "or use prompts without images",
        )
    shown = sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "image"
    )
    pictures = [open_image(source, conv.base) for source in conv.images[:shown]]
    return vlm.image_prompt(
        processor, vlm.chat_template_tokenizer(processor, tokenizer), messages, pictures
    )
