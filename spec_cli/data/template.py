"""Tokenise one conversation with the target's chat template and mark what the assistant produces.

The supervised text is derived from the template itself, never from role strings:
- if the template has `{% generation %}` markers, transformers' assistant mask is used;
- otherwise, for assistant turn i, the template is rendered for messages[:i] with the generation
  prompt and for messages[:i+1]; the difference is the assistant's turn as the template writes it.
  Inside it, the message text is supervised plus everything up to and including the first special
  token after it (the end-of-turn token the model must emit). Template scaffolding before the text
  (role headers, empty think blocks) and after the end-of-turn token stays unsupervised.
An assistant message with `"finish_reason": "length"` was cut at a length limit: the model never
emitted its end-of-turn token, so only its text is supervised (with either rule above).
Character spans are mapped to tokens with the fast tokenizer's offset mapping.
"""

from __future__ import annotations

import numpy as np

from spec_cli.data import records


class TemplateMismatch(Exception):
    """The template does not render a message's text verbatim, so its span cannot be found."""


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def special_token_strings(tokenizer) -> list[str]:
    """Text of every special added token (end-of-turn candidates)."""
    tokens = {tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special}
    tokens |= set(tokenizer.all_special_tokens)
    return sorted((t for t in tokens if t), key=len, reverse=True)


def cut_at_length(message: dict) -> bool:
    """An answer cut at the length limit: the template closes it with a token the model never emitted."""
    return message.get("finish_reason") == "length"


def _first_special(text: str, start: int, end: int, specials: list[str]) -> tuple[int, int] | None:
    best = None
    for tok in specials:
        pos = text.find(tok, start, end)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, pos + len(tok))
    return best


def assistant_spans(
    tokenizer, messages: list[dict], full: str, specials: list[str]
) -> list[tuple[int, int]]:
    """Character spans of `full` that the assistant turns produce."""
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        region = None
        try:
            prefix = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
            upto = render(tokenizer, messages[: i + 1])
            if i and full.startswith(upto) and upto.startswith(prefix) and len(prefix) >= cursor:
                region = (len(prefix), len(upto))
        except Exception:  # templates may refuse a prefix (e.g. one that ends on a system turn)
            region = None
        if region is None:  # fall back to a forward search from the previous turn
            region = (cursor, len(full))
        text = message["content"]
        start = full.find(text, region[0], region[1]) if text else -1
        if start == -1 and text.strip():
            text = text.strip()
            start = full.find(text, region[0], region[1])
        if start == -1:
            if text.strip():
                raise TemplateMismatch(f"assistant turn {i} is not rendered verbatim")
            start = region[0]  # empty message: only the end-of-turn token is produced
            text = ""
        end = start + len(text)
        eot = _first_special(full, end, region[1], specials)
        if eot is not None and not cut_at_length(message):
            end = eot[1]
        spans.append((start, end))
        cursor = end
    return spans


def _mask_from_spans(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose characters overlap a span. offsets: [T, 2]."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    starts, ends = offsets[:, 0], offsets[:, 1]
    for a, b in spans:
        mask |= ((starts < b) & (ends > a) & (ends > starts)).astype(np.uint8)
    return mask


def _unmask_unemitted_eot(
    tokenizer, messages: list[dict], ids: np.ndarray, mask: np.ndarray
) -> None:
    """Generation-marker masks: run k of supervised tokens is assistant message k. Where that message
    was cut at the length limit, drop the run's last token when it is a special token (the end-of-turn
    token the template adds). Left as is when the runs do not line up with the messages."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, ends = (
        np.flatnonzero(edges == 1),
        np.flatnonzero(edges == -1),
    )  # run k: [starts[k], ends[k])
    answers = [m for m in messages if m["role"] == "assistant"]
    if len(starts) != len(answers):
        return
    special_ids = set(tokenizer.all_special_ids) | {
        i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special
    }
    for message, end in zip(answers, ends):
        if cut_at_length(message) and int(ids[end - 1]) in special_ids:
            mask[end - 1] = 0


def has_generation_markers(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "{% generation %}" in template.replace(
        "{%-", "{%"
    ).replace("-%}", "%}")


def encode_chat(
    tokenizer, messages: list[dict], specials: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids [T] int32, loss_mask [T] uint8) for one conversation."""
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = np.asarray(out["input_ids"], dtype=np.int32)
        mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
        if any(cut_at_length(m) for m in messages if m["role"] == "assistant"):
            _unmask_unemitted_eot(tokenizer, messages, ids, mask)
        return ids, mask
    full = render(tokenizer, messages)
    spans = assistant_spans(tokenizer, messages, full, specials)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    return np.asarray(enc["input_ids"], dtype=np.int32), _mask_from_spans(offsets, spans)


def encode_text(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(tokenizer(text, add_special_tokens=True)["input_ids"], dtype=np.int32)
    return ids, np.ones(len(ids), dtype=np.uint8)


def begins_with_assistant(messages: list[dict]) -> bool:
    """The first turn after any system turns is the assistant's (ShareGPT has many: the human's opening
    turn was lost). Templates that require roles to alternate from `user` (Gemma, Mistral) refuse them."""
    first = next((m for m in messages if m["role"] != "system"), None)
    return first is not None and first["role"] == "assistant"


# Tokens past max_length are cut anyway, so a record is cut first where none of the first max_length
# tokens can change: after (max_length + MARGIN) tokens' worth of characters, a token covering at most as
# many characters as the vocabulary's longest token has. A 50 MB record then costs what a short one does.
MARGIN = 64


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry: a byte-level
    entry has one character per byte, so it bounds the text characters it covers too). Kept on it."""
    longest = getattr(tokenizer, "_spec_longest_token", None)
    if longest is None:
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max((len(t) for t in tokens if isinstance(t, str)), default=1)
        try:
            tokenizer._spec_longest_token = longest
        except AttributeError:
            pass
    return longest


def bounded(kind: str, value, tokenizer, max_length: int):
    """The record's text ("text") or messages ("chat") cut after the characters its first max_length tokens
    can come from (with a margin): the same first max_length tokens, at a bounded cost. Messages after
    the budget is spent keep one character each, so the turns (and whether an answer was cut) stay."""
    budget = (max_length + MARGIN) * longest_token_chars(tokenizer)
    if kind == "text":
        return value[:budget]
    out, left = [], budget
    for message in value:
        content = message.get("content")
        if isinstance(content, str) and len(content) > max(left, 1):
            message = {**message, "content": content[: max(left, 1)]}
        out.append(message)
        left -= len(content) if isinstance(content, str) else 0
    return out


def encode_record(
    tokenizer, record: dict, max_length: int, specials: list[str]
) -> tuple[np.ndarray, np.ndarray] | str:
    """Tokens and loss mask for one record, or the reason it is skipped."""
    kind, value = records.normalise(record)
    if kind == "skip":
        return value
    value = bounded(kind, value, tokenizer, max_length)
    if kind == "chat" and not getattr(tokenizer, "chat_template", None):
        return records.NO_TEMPLATE  # tokenize_data says so once, naming --chat-template
    try:
        if kind == "text":
            ids, mask = encode_text(tokenizer, value)
        else:
            ids, mask = encode_chat(tokenizer, value, specials)
    except TemplateMismatch:
        return records.TEMPLATE
    except Exception:  # jinja errors: e.g. roles that do not alternate, unsupported system turn
        return (
            records.ASSISTANT_FIRST
            if kind == "chat" and begins_with_assistant(value)
            else records.TEMPLATE
        )
    if not mask.any():
        return records.EMPTY
    ids, mask = ids[:max_length], mask[:max_length]
    if not mask.any():
        return records.TRUNCATED
    return ids, mask
