"""Read local chat data with `datasets` and normalise each record to messages or plain text.

Shapes accepted:
- ShareGPT: {"conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}
- OpenAI-style: {"messages": [{"role": "user"|"assistant"|..., "content": str | [parts]}, ...]}
- plain text: {"text": str}  (every token supervised)

An assistant message may carry `"finish_reason": "length"` (written by `spec regenerate` when the
answer was cut at the length limit): it is kept, and the loss mask then leaves out the end-of-turn
token the model never emitted.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

from spec_cli.errors import DataError

ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
}

# Why a record was skipped (the keys of the summary's skip table).
EMPTY = "empty"
MALFORMED = "malformed"
NO_ASSISTANT = "no assistant turn"
TEMPLATE = "chat template rejected it"
ASSISTANT_FIRST = "begins with an assistant turn (the chat template refuses it)"
NO_TEMPLATE = "no chat template"  # never in a summary: tokenize_data stops with one error instead
TRUNCATED = "no supervised token after truncation"
IMAGES = "holds images (read with a vision-language target's processor: docs/vlm.md)"
IMAGE_PARTS = ("image", "image_url", "input_image")  # OpenAI-style content parts that carry an image


def _blank(path: Path) -> bool:
    """A file of no bytes, or (JSON) only whitespace."""
    size = path.stat().st_size
    if size == 0:
        return True
    if path.suffix in (".jsonl", ".json") and size <= 1 << 16:
        return not path.read_bytes().strip()
    return False


def _no_records(path: Path) -> bool:
    """A small JSON file that parses to an empty list or object."""
    try:
        return json.loads(path.read_bytes()) in ([], {})
    except ValueError:
        return False


def _utf8(path: Path) -> bool:
    """Whether a JSON (lines) file is all UTF-8, read in 16 MiB pieces (about 1 s per GB)."""
    if path.suffix not in (".jsonl", ".json"):
        return True
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while piece := f.read(1 << 24):
                decoder.decode(piece)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def _not_utf8(path: Path) -> str | None:
    """Where a data file first stops being UTF-8: "record N (line N)" in JSON lines, else the byte."""
    offset = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                if path.suffix == ".jsonl":
                    return f"record {number} (line {number}, byte {exc.start + 1} of the line)"
                return f"byte {offset + exc.start}"
            offset += len(line)
    return None


def load_records(path: str | Path):
    """A `datasets.Dataset` of the records in a .jsonl/.json/.parquet file or a saved dataset folder."""
    import datasets

    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"data not found: {path}",
                        "pass a .jsonl, .json or .parquet file, a saved dataset folder, or `sharegpt`")
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own error lines: ours says it once
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                split = "train" if "train" in loaded else next(iter(loaded))
                loaded = loaded[split]
            return loaded
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if builder is None:
            raise DataError(f"unsupported data file {path.name}",
                            "use .jsonl, .json, .parquet or a folder saved with datasets' save_to_disk")
        if _blank(path):  # datasets fails on it with an empty message
            raise DataError(f"{path} is empty: it holds no records",
                            "pass a data file with one record per line (ShareGPT `conversations`, OpenAI "
                            "`messages` or `text`)")
        if not _utf8(path):  # pyarrow takes such bytes in, and a later read of the record fails
            raise DataError(f"{path}: {_not_utf8(path)} is not valid UTF-8",
                            "fix or remove it (data files are read as UTF-8)")
        if path.suffix == ".json" and path.stat().st_size <= 1 << 16 and _no_records(path):
            raise DataError(f"no records in {path}", "pass a file that holds conversations (a JSON list of "
                                                     "records, or JSON lines)")
        loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
        if len(loaded) == 0:
            raise DataError(f"no records in {path}", "pass a file that holds conversations")
        return loaded
    except DataError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many types for unreadable files
        cause = exc.__cause__ or exc.__context__
        detail = f"{exc} ({cause})" if cause is not None and str(cause) not in str(exc) else str(exc)
        raise DataError(f"cannot read {path}: {detail}",
                        "check the file is valid JSON lines / JSON / parquet with one record per row") from exc
    finally:
        datasets.logging.set_verbosity(verbosity)


def has_images(record: dict) -> bool:
    """An image-text record: OpenAI-style image content parts, or ShareGPT's `image` / `images` field."""
    if record.get("image") or record.get("images"):
        return True
    turns = record.get("messages") or record.get("conversations") or []
    contents = [turn.get("content") for turn in turns if isinstance(turn, dict)] if isinstance(turns, list) else []
    return any(isinstance(part, dict) and part.get("type") in IMAGE_PARTS
               for content in contents if isinstance(content, list) for part in content)


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(
                    part.get("text"), str):
                texts.append(part["text"])
            else:
                return None
        return "".join(texts)
    return None


def normalise(record: dict, require_assistant: bool = True) -> tuple[str, Any]:
    """("chat", messages) | ("text", str) | ("skip", reason). `require_assistant=False` keeps chats
    without an assistant turn (prompts for `spec regenerate`)."""
    if has_images(record):  # counted apart: a vision-language draft needs the images (not built yet)
        return "skip", IMAGES
    turns = None
    if record.get("conversations") is not None:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif record.get("messages") is not None:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif record.get("text") is not None:
        text = record["text"]
        if not isinstance(text, str):
            return "skip", MALFORMED
        return ("text", text) if text.strip() else ("skip", EMPTY)
    else:
        return "skip", MALFORMED

    if not isinstance(turns, list):
        return "skip", MALFORMED
    if not turns:
        return "skip", EMPTY
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return "skip", MALFORMED
        # tolerate either key spelling inside either container
        role = turn.get(role_key) if turn.get(role_key) is not None else turn.get(
            "role" if role_key == "from" else "from")
        content = turn.get(text_key) if turn.get(text_key) is not None else turn.get(
            "content" if text_key == "value" else "value")
        role = ROLES.get(str(role).strip().lower()) if role is not None else None
        text = _content_text(content)
        if role is None or text is None:
            return "skip", MALFORMED
        message = {"role": role, "content": text}
        if role == "assistant" and turn.get("finish_reason") in ("stop", "length"):
            message["finish_reason"] = turn["finish_reason"]
        messages.append(message)
    if not any(m["content"].strip() for m in messages):
        return "skip", EMPTY
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        return "skip", NO_ASSISTANT
    return "chat", messages
