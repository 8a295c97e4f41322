"""Image-text chats through the target's own processor (docs/vlm.md).

A record with images is rendered with the processor's chat template (each image part becomes the
template's image marker) and its assistant spans are found as for text (data/template.py). The
rendered text is then tokenised twice: alone, with character offsets (the loss mask), and by the
processor with the record's images, which expands each marker into the image's placeholder tokens
(how many depends on the image for tiling processors such as Idefics3's). The expansion only inserts
or rewrites tokens around the markers, so aligning the two token lists carries the mask over to the
expanded ids: the assistant's text is supervised, never an image token. The expanded length is what
batch planning counts.

At training time the images are read again from the data (`ImageInputs`), by the record each sample
came from, and the processor's image processor turns a batch's images into the model's inputs.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from spec_cli.data import records
from spec_cli.data.images import MARKER, image_refs, open_image
from spec_cli.data.template import (
    TemplateMismatch,
    _mask_from_spans,
    assistant_spans,
    render,
)
from spec_cli.errors import DataError

# Why an image record was skipped (keys of the tokenising summary's skip table)
IMAGE_IN_ANSWER = "an image in an assistant turn (the draft is trained on the assistant's text)"
IMAGES_CUT = "its images do not fit in --max-length (an image is never cut)"
IMAGES_TWICE = (
    "images both in its turns' parts and in an images field (which goes where is not written)"
)
# Per-token ids some processors return beside the tokens, that the model reads (Gemma 3's token types
# let an image's tokens attend to each other both ways; Qwen3-VL's mark image and video tokens).
TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")


def processor_fingerprint(processor) -> str:
    """The processor's settings and chat template: they decide the tokens an image-text record gets."""
    described = {
        "class": type(processor).__name__,
        "image_processor": processor.image_processor.to_dict(),
        "chat_template": getattr(processor, "chat_template", None),
    }
    for name in (
        "image_seq_length",
        "image_seq_len",
        "num_image_tokens",
        "patch_size",
        "image_token",
    ):
        described[name] = getattr(processor, name, None)
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[
        :20
    ]


def chat_template_tokenizer(processor, tokenizer):
    """The tokenizer that renders image-text chats: the processor's own, with the processor's chat
    template unless --chat-template replaced the target's (then that one, as for text records)."""
    renderer = processor.tokenizer
    override = bool(getattr(tokenizer, "spec_chat_template_override", False))
    if override or not getattr(processor, "chat_template", None):
        renderer.chat_template = getattr(tokenizer, "chat_template", None)
    else:
        renderer.chat_template = processor.chat_template
    renderer.spec_chat_template_override = override
    return renderer


def check_renders_images(processor, renderer) -> None:
    """DataError unless the chat template `renderer` holds places an image where the processor expands one
    (a text family's --chat-template writes no image marker, or fails on a message of parts): a probe chat
    with one drawn image goes through both, before any record does."""
    from PIL import Image

    probe = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": "A gray square."},
    ]
    try:
        processor(
            text=[render(renderer, probe)], images=[[Image.new("RGB", (64, 64), (128, 128, 128))]]
        )
    except Exception as exc:  # noqa: BLE001 (jinja's errors, the processor's count check)
        override = getattr(renderer, "spec_chat_template_override", False)
        raise DataError(
            f"the chat template{' from --chat-template' if override else ''} does not place an image "
            f"where the target's processor expects it ({type(exc).__name__}: {str(exc)[:160]})",
            "drop --chat-template for image-text data: the target's own template renders images"
            if override
            else "check the target's chat template renders image content parts",
        ) from None


def _parts(content, listed: bool) -> list[dict] | None:
    """A turn's content as OpenAI parts with every image a bare {"type": "image"} (its source is read
    apart, in image_refs' order); ShareGPT text splits at its <image> markers when the record lists
    images. None: malformed."""
    if isinstance(content, str):
        if not listed or MARKER not in content:
            return [{"type": "text", "text": content}]
        parts = []
        for i, piece in enumerate(content.split(MARKER)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts
    if not isinstance(content, list):
        return None
    parts = []
    for part in content:
        if not isinstance(part, dict):
            return None
        kind = part.get("type", "text")
        if kind in records.IMAGE_PARTS:
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            return None
    return parts


def image_chat(record: dict, require_assistant: bool = True) -> tuple[str, list[dict] | str]:
    """("chat", messages) for an image-text record, the images as {"type": "image"} parts where the
    model sees them (a user turn's content a list of parts; an assistant's its text), or ("skip",
    reason). `require_assistant=False` keeps chats without an answer (prompts for `spec regenerate`)."""
    listed = record.get("images") is not None or record.get("image") is not None
    key = (
        "messages" if isinstance(record.get("messages"), list) else "conversations"
    )  # (images.image_refs' order)
    turns = record.get(key)
    if not isinstance(turns, list) or not turns:
        return "skip", records.MALFORMED
    inline = any(
        isinstance(t, dict)
        and isinstance(t.get("content", t.get("value")), list)
        and any(
            isinstance(p, dict) and p.get("type") in records.IMAGE_PARTS
            for p in t.get("content", t.get("value"))
        )
        for t in turns
    )
    if listed and inline:  # two orders for the images: which goes where is not written down
        return "skip", IMAGES_TWICE
    messages, markers = [], 0
    for turn in turns:
        if not isinstance(turn, dict):
            return "skip", records.MALFORMED
        role = turn.get("role", turn.get("from"))
        role = records.ROLES.get(str(role).strip().lower()) if role is not None else None
        parts = _parts(turn.get("content", turn.get("value")), listed)
        if role is None or parts is None:
            return "skip", records.MALFORMED
        images = sum(p["type"] == "image" for p in parts)
        markers += images
        if role == "assistant":
            if images:
                return "skip", IMAGE_IN_ANSWER
            message = {"role": role, "content": "".join(p["text"] for p in parts)}
            if turn.get("finish_reason") in ("stop", "length"):
                message["finish_reason"] = turn["finish_reason"]
        else:
            message = {
                "role": role,
                "content": parts if images else "".join(p["text"] for p in parts),
            }
        messages.append(message)
    if (
        listed and not markers
    ):  # LLaVA's convention: the images come before the first user turn's text
        count = len(image_refs(record))
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is None:
            return "skip", records.MALFORMED
        text = first["content"]
        first["content"] = [{"type": "image"}] * count + (
            [{"type": "text", "text": text}] if text else []
        )
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        return "skip", records.NO_ASSISTANT
    return "chat", messages


def resolved_source(source: str, base: Path | None) -> str:
    """An image source that reads the same from anywhere: a relative path made absolute against `base`
    (the data file's folder); data URLs, base64 and absolute paths as they are."""
    if source.startswith("data:") or len(source) > 256:
        return source
    path = Path(source[len("file://") :] if source.startswith("file://") else source).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return str(path.resolve()) if path.is_absolute() else source


def sourced_image_chat(record: dict, base: Path | None, require_assistant: bool = True):
    """image_chat with each image part naming its image ({"type": "image", "image": source}, sources made
    absolute): such messages can be written to another file and read from there."""
    kind, messages = image_chat(record, require_assistant)
    if kind == "skip":
        return kind, messages
    sources = iter(image_refs(record))
    for message in messages:
        if isinstance(message["content"], list):
            message["content"] = [
                {"type": "image", "image": resolved_source(next(sources).source, base)}
                if part["type"] == "image"
                else part
                for part in message["content"]
            ]
    return kind, messages


class ImagePrompt(list):
    """A prompt's token ids with the model inputs of its images (`images`: pixel values and what else
    the processor gives), which the target's first forward takes."""

    def __init__(self, ids: list[int], images: dict):
        super().__init__(ids)
        self.images = images


def image_prompt(processor, renderer, messages: list[dict], pictures: list) -> ImagePrompt:
    """The prompt of a chat with images (`pictures`: those of its image parts, in order), ending with the
    assistant's generation prompt, as the processor expands them."""
    text = render(renderer, messages, add_generation_prompt=True)
    out = processor(
        text=[text],
        images=[pictures] if pictures else None,
        add_special_tokens=False,
        return_tensors="pt",
    )
    return ImagePrompt(
        out["input_ids"][0].tolist(),
        {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")},
    )


def has_image_parts(messages: list[dict]) -> bool:
    return any(
        isinstance(m["content"], list) and any(p.get("type") == "image" for p in m["content"])
        for m in messages
    )


def align_mask(
    plain: np.ndarray, mask: np.ndarray, expanded: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(mask over `expanded`, 1 where a token came from the expansion) by aligning the tokens of the
    rendered text (`plain`, with `mask`) to the processor's (`expanded`): tokens the two share keep their
    mask; tokens the processor inserted or rewrote (the image's) are never supervised. TemplateMismatch
    when a supervised token was rewritten (an image next to the assistant's text)."""
    matcher = difflib.SequenceMatcher(None, plain.tolist(), expanded.tolist(), autojunk=False)
    out = np.zeros(len(expanded), dtype=np.uint8)
    added = np.ones(len(expanded), dtype=np.uint8)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            out[b0:b1] = mask[a0:a1]
            added[b0:b1] = 0
        elif mask[a0:a1].any():
            raise TemplateMismatch("the processor rewrote supervised tokens")
    return out, added


def encode_image_chat(
    processor, renderer, messages: list[dict], images: list, specials: list[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """(input_ids [T] int32, loss_mask [T] uint8, (argument name, token types [T] uint8) or None, how
    many leading tokens hold every image token) for one image-text conversation, the images expanded as
    the processor expands them."""
    full = render(renderer, messages)
    spans = assistant_spans(renderer, messages, full, specials)
    enc = renderer(full, add_special_tokens=False, return_offsets_mapping=True)
    plain = np.asarray(enc["input_ids"], dtype=np.int64)
    mask = _mask_from_spans(np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2), spans)
    out = processor(text=[full], images=[images], add_special_tokens=False)
    expanded = np.asarray(out["input_ids"][0], dtype=np.int64)
    loss_mask, added = align_mask(plain, mask, expanded)
    types = next(
        ((k, np.asarray(out[k][0], dtype=np.uint8)) for k in TOKEN_TYPE_KEYS if k in out), None
    )
    return expanded.astype(np.int32), loss_mask, types, image_reach(renderer, expanded, added)


def image_reach(tokenizer, expanded: np.ndarray, added: np.ndarray) -> int:
    """How many leading tokens a cut must keep for no image to lose a token: past the last inserted token
    and the last of any special token the expansion uses (its placeholder and frame tokens: the alignment
    may pair the rendered text's one placeholder with any copy of it)."""
    inserted = np.flatnonzero(added)
    if not len(inserted):
        return 0
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    marks = [t for t in set(expanded[inserted].tolist()) if t in special]
    last = int(inserted[-1])
    if marks:
        last = max(last, int(np.flatnonzero(np.isin(expanded, marks))[-1]))
    return last + 1


def encode_image_record(
    processor, renderer, record: dict, base: Path | None, max_length: int, specials: list[str]
):
    """(ids, mask, (type key, types) or None, number of images) for one image-text record, or the reason
    it is skipped.
    The images were checked before (images.check_images): a failure to open one here is a DataError."""
    kind, messages = image_chat(record)
    if kind == "skip":
        return messages
    pictures = [open_image(ref.source, base) for ref in image_refs(record)]
    try:
        ids, mask, types, reach = encode_image_chat(
            processor, renderer, messages, pictures, specials
        )
    except TemplateMismatch:
        return records.TEMPLATE
    except DataError:
        raise
    except Exception:  # noqa: BLE001 (jinja errors, a processor refusing the record)
        return records.TEMPLATE
    if not mask.any():
        return records.EMPTY
    if reach > max_length:
        return IMAGES_CUT
    ids, mask = ids[:max_length], mask[:max_length]
    if not mask.any():
        return records.TRUNCATED
    return ids, mask, None if types is None else (types[0], types[1][:max_length]), len(pictures)


def image_base(data_path: Path) -> Path:
    """The folder a record's relative image paths start from: the data file's, or a saved data set's."""
    path = Path(data_path).expanduser()
    return path if path.is_dir() else path.parent


class ImageInputs:
    """The model inputs for a batch's images: each sample's images read again from the record it came
    from, through the processor's image processor (one call per batch: it pads and stacks as the
    model expects), plus the per-token types some models read, right-padded like the tokens."""

    def __init__(
        self,
        processor,
        data_path: Path,
        source_index: torch.Tensor,
        num_images: torch.Tensor,
        token_types: torch.Tensor | None,
        type_key: str | None,
        offsets: torch.Tensor,
    ):
        from spec_cli.data.records import load_records

        self.processor, self.base = processor, image_base(data_path)
        self.dataset = load_records(data_path)
        self.source_index, self.num_images = source_index, num_images
        self.token_types, self.type_key, self.offsets = token_types, type_key, offsets

    def __call__(self, indices: list[int], length: int, packed: bool = False) -> dict | None:
        """Keyword arguments for the model's forward over the samples `indices` right-padded to
        `length` tokens (packed: all of them in one row, in order); None when none of them has an image."""
        chosen = [i for i in indices if int(self.num_images[i])]
        if not chosen:
            return None
        pictures = [
            [
                open_image(ref.source, self.base)
                for ref in image_refs(self.dataset[int(self.source_index[i])])
            ]
            for i in chosen
        ]
        inputs = dict(self.processor.image_processor(images=pictures, return_tensors="pt"))
        if self.type_key is not None:
            types = torch.zeros(1 if packed else len(indices), length, dtype=torch.long)
            at = 0
            for row, i in enumerate(indices):
                a, b = int(self.offsets[i]), int(self.offsets[i + 1])
                if packed:
                    types[0, at : at + b - a] = self.token_types[a:b].long()
                    at += b - a
                else:
                    types[row, : b - a] = self.token_types[a:b].long()
            inputs[self.type_key] = types
        return inputs
