"""`--chat-template FILE_OR_NAME`: the chat template a target's conversations are rendered with.

A target's own template (its tokenizer's `chat_template`) is used unless one is given: a Jinja file, a
`tokenizer_config.json` / `chat_template.json` holding one, or the name of a family shipped here
(`FAMILIES`). Base models usually have none; pair them with the family they will be served with.

The template is part of the tokenizer's fingerprint (`tokenizer_fingerprint` hashes it), so every
artifact made with one template (tokenised data, vocab map, feature cache, run, export) is refused by a
stage that runs with another; `chat_template_sha256` is recorded beside it to say so in those words.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from spec_cli.errors import ConfigError, TargetError

OPTION = "--chat-template"

# Family templates, written after the official ones (string contents only: the data pipeline gives
# every message a str). `markers`: the control strings the template writes, which must be single
# tokens of the target's tokenizer for the template to mean what the family's models were trained on;
# `end_of_turn`: the token an answer ends with (generation stops there, as at the eos).
FAMILIES = {
    "chatml": dict(
        markers=("<|im_start|>", "<|im_end|>"),
        end_of_turn="<|im_end|>",
        text=(
            "{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        ),
    ),
    "llama3": dict(
        markers=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        end_of_turn="<|eot_id|>",
        text=(
            "{{- bos_token }}"
            "{%- for message in messages %}"
            "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
            " + '<|eot_id|>' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
            "{%- endif %}"
        ),
    ),
    # Gemma 1-3: a system turn is folded into the first user turn; roles must alternate from `user`.
    "gemma": dict(
        markers=("<start_of_turn>", "<end_of_turn>"),
        end_of_turn="<end_of_turn>",
        text=(
            "{{- bos_token }}"
            "{%- if messages[0]['role'] == 'system' %}"
            "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
            "{%- set loop_messages = messages[1:] %}"
            "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
            "{%- for message in loop_messages %}"
            "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
            "{%- endif %}"
            "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
            "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '')"
            " + message['content'] | trim + '<end_of_turn>\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
        ),
    ),
    # Mistral v1 ([INST]): user/assistant only, alternating from `user`; answers end with eos.
    "mistral": dict(
        markers=("[INST]", "[/INST]"),
        end_of_turn=None,  # the tokenizer's eos
        text=(
            "{{- bos_token }}"
            "{%- for message in messages %}"
            "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
            "{%- endif %}"
            "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
            "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
            "{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}{%- endif %}"
            "{%- endfor %}"
        ),
    ),
}


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # "family chatml" or the file it was read from
    text: str
    markers: tuple[str, ...] = ()  # family templates: control strings that must be single tokens
    end_of_turn: str | None = None  # family templates: the token that closes an answer

    @property
    def sha256(self) -> str:
        return template_sha256(self.text)


def template_sha256(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text else None


def resolve(value: str | Path | None) -> ChatTemplate | None:
    """`--chat-template` -> a ChatTemplate (None: the target's own)."""
    if value in (None, ""):
        return None
    name = str(value).strip()
    if name.lower() in FAMILIES and not Path(name).exists():
        family = FAMILIES[name.lower()]
        return ChatTemplate(
            f"family {name.lower()}", family["text"], family["markers"], family["end_of_turn"]
        )
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"{OPTION} {name!r} is neither a file nor a known template family",
            f"pass a Jinja file, or one of {', '.join(FAMILIES)}",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {OPTION} {path}: {exc}", "pass a UTF-8 Jinja file") from exc
    if path.suffix == ".json":  # tokenizer_config.json / chat_template.json
        try:
            text = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            text = None
        if isinstance(text, list):  # named templates: [{"name": "default", "template": ...}, ...]
            text = next(
                (
                    t.get("template")
                    for t in text
                    if isinstance(t, dict) and t.get("name") == "default"
                ),
                None,
            )
        if not isinstance(text, str):
            raise ConfigError(
                f"{OPTION} {path} holds no `chat_template` string",
                "pass a Jinja file, or a tokenizer_config.json that has a chat_template",
            )
    if not text.strip():
        raise ConfigError(f"{OPTION} {path} is empty", "pass a Jinja chat template")
    _compile(text, path)
    return ChatTemplate(str(path.resolve()), text)


def _compile(text: str, path: Path) -> None:
    """A syntax error is reported here, once, not as every record being refused."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(
            text.replace("{% generation %}", "")
            .replace("{% endgeneration %}", "")
            .replace("{%- generation %}", "")
            .replace("{%- endgeneration %}", "")
        )
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(
            f"{OPTION} {path} is not a valid Jinja template (line {exc.lineno}: {exc.message})",
            "fix the template file",
        ) from exc


def apply(tokenizer, template: ChatTemplate | None):
    """Install `template` on the tokenizer (in place); warn when a family's markers are not single tokens."""
    if template is None:
        return tokenizer
    tokenizer.chat_template = template.text
    tokenizer.spec_chat_template_override = (
        True  # image-text chats then render with it too (data/vlm.py)
    )
    split = [
        m for m in template.markers if len(tokenizer(m, add_special_tokens=False)["input_ids"]) != 1
    ]
    if split:
        from spec_cli.console import warn

        warn(
            f"the {template.source} chat template writes {', '.join(split)}, which this tokenizer splits into "
            "several ordinary tokens: the target was not trained on this format (its end-of-turn is then not "
            "supervised); use the family the target is served with"
        )
    return tokenizer


def end_of_turn_ids(tokenizer, template: ChatTemplate | None) -> frozenset[int]:
    """The template's end-of-turn token (when it is one token): generation stops at it, as at the eos (a
    base model's generation config names only its eos). A family declares it; for a file it is read off
    the template: the special token it writes right after an answer."""
    if template is None:
        return frozenset()
    end = template.end_of_turn or _closing_special_token(tokenizer, template.text)
    if not end:
        return frozenset()
    ids = tokenizer(end, add_special_tokens=False)["input_ids"]
    return frozenset(ids) if len(ids) == 1 else frozenset()


def _closing_special_token(tokenizer, text: str) -> str | None:
    """The special token `text` renders right after an assistant's answer (`<end_of_turn>`, `<|im_end|>`,
    `</s>`), or None (nothing special there, or the template cannot render a plain user/assistant chat)."""
    answer = "spec-cli-answer"
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}],
            chat_template=text,
            tokenize=False,
        )
    except Exception:  # noqa: BLE001 - a template may refuse this chat; then there is nothing to read
        return None
    if not isinstance(rendered, str) or answer not in rendered:
        return None
    after = tokenizer(rendered.split(answer, 1)[1], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    return tokenizer.convert_ids_to_tokens(after[0]) if after and after[0] in special else None


def source_of(tokenizer, template: ChatTemplate | None) -> str:
    """Where the template in use comes from (recorded next to its sha256)."""
    if template is not None:
        return template.source
    return "the target's tokenizer" if getattr(tokenizer, "chat_template", None) else "none"


_OWN = object()


def tokenizer_fingerprint(tokenizer, chat_template=_OWN) -> str:
    """Changes whenever tokenisation or the chat template could change. `chat_template=None` gives the
    fingerprint of the tokenizer alone (recorded to tell a different template from a different tokenizer)."""
    template = getattr(tokenizer, "chat_template", None) if chat_template is _OWN else chat_template
    digest = hashlib.sha256()
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(str(template).encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def require(tokenizer, target: Path | str, purpose: str = "chat data") -> None:
    """One error for a target without a chat template, where conversations must be rendered."""
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(
            f"the tokenizer of {target} has no chat template, so {purpose} cannot be rendered "
            "(a base model usually has none)",
            f"pass {OPTION} FILE.jinja or a family name ({', '.join(FAMILIES)}): the template "
            "the draft will be served with",
        )


def identity(tokenizer, template: ChatTemplate | None) -> dict:
    """What artifacts record about the template in use (and the tokenizer's fingerprint without it, so a
    later mismatch can be put down to the template or to the tokenizer)."""
    return {
        "chat_template_sha256": template_sha256(getattr(tokenizer, "chat_template", None)),
        "chat_template_source": source_of(tokenizer, template),
        "tokenizer_base_fingerprint": tokenizer_fingerprint(tokenizer, chat_template=None),
    }


def mismatch(
    recorded: dict, tokenizer, template: ChatTemplate | None, what: str
) -> tuple[str, str] | None:
    """(message, hint) when `recorded` (an artifact's metadata) was made with the same tokenizer but another
    chat template than the one in use; None when the templates agree, the tokenizers themselves differ,
    or the artifact did not record them."""
    if "chat_template_sha256" not in recorded or not recorded.get("tokenizer_base_fingerprint"):
        return None
    if recorded["tokenizer_base_fingerprint"] != tokenizer_fingerprint(
        tokenizer, chat_template=None
    ):
        return None  # another tokenizer altogether: the caller says so
    made, now = (
        recorded.get("chat_template_sha256"),
        template_sha256(getattr(tokenizer, "chat_template", None)),
    )
    if made == now:
        return None
    made_from = recorded.get("chat_template_source") or "an unrecorded source"
    made_desc = (
        f"the chat template of {made_from} (sha256 {made[:12]})" if made else "no chat template"
    )
    now_desc = (
        f"the chat template of {source_of(tokenizer, template)} (sha256 {now[:12]})"
        if now
        else "no chat template"
    )
    if made_from.startswith("family "):
        fix = f"pass {OPTION} {made_from.removeprefix('family ')}"
    elif made_from in ("the target's tokenizer", "none") or not made:
        fix = f"drop {OPTION}"
    else:
        fix = f"pass {OPTION} {made_from}"
    return (
        f"{what} was made with {made_desc}; this run renders conversations with {now_desc}",
        f"{fix} as when it was made, or rebuild it with this template",
    )
