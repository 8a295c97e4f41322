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
import io
import json
from pathlib import Path
from typing import Any

from spec_cli.errors import DataError

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
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
IMAGE_PARTS = (
    "image",
    "image_url",
    "input_image",
)  # OpenAI-style content parts that carry an image


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


CHUNK = (
    10 << 20
)  # bytes read at a time, as datasets' JSON loader does (it types the columns from its first)
READ_HINT = "check the file is valid JSON lines / JSON / parquet with one record per row"


def _json_lines(path: Path) -> bool:
    """A JSON-lines file: its first line is one whole JSON object (.jsonl: begins one). datasets reads a
    JSON list, or one object over many lines, whole."""
    with open(path, "rb") as f:
        first = f.readline().removeprefix(codecs.BOM_UTF8).strip()
    if path.suffix == ".jsonl":
        return first.startswith(b"{")
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _objects(path: Path, chunk: bytes, first_line: int) -> list[dict]:
    """The records of a chunk of JSON lines; DataError naming the first line that is not a JSON object."""
    objects = []
    for number, text in enumerate(chunk.split(b"\n"), first_line):
        if not text.strip():
            continue
        try:
            value = json.loads(
                text, parse_constant=_no_constant
            )  # NaN / Infinity: pyarrow refuses them
        except ValueError as exc:
            why = (
                f"{exc.msg}, column {exc.colno}"
                if isinstance(exc, json.JSONDecodeError)
                else str(exc)
            )
            raise DataError(
                f"{path}: line {number} is not valid JSON ({why})",
                "fix or remove that line (JSON lines: one JSON object per line)",
            ) from None
        if not isinstance(value, dict):
            raise DataError(
                f"{path}: line {number} is a JSON {type(value).__name__}, not an object",
                "write each record as one JSON object per line",
            ) from None
        objects.append(value)
    return objects


def _chunk_type(path: Path, chunk: bytes, first_line: int, json_paths: list):
    """The arrow struct of a chunk's records. A field whose values differ in kind within it (a string
    here, a list there) joins `json_paths`, and is read as JSON text."""
    import pyarrow as pa
    import pyarrow.json as paj
    from datasets.utils.json import get_json_field_path_from_pyarrow_json_error, json_encode_field

    encoded = chunk
    while True:
        try:  # one block: a record never straddles two
            table = paj.read_json(
                io.BytesIO(encoded), read_options=paj.ReadOptions(block_size=len(encoded) + 1)
            )
            return pa.struct(list(table.schema))
        except pa.ArrowInvalid as exc:
            examples = _objects(
                path, chunk, first_line
            )  # DataError on a line that is not a JSON object
            field = (
                get_json_field_path_from_pyarrow_json_error(str(exc), examples=examples)
                if ") changed from" in str(exc)
                else None
            )
            if not field or field in json_paths:
                raise
            json_paths.append(field)
            for field_path in json_paths:
                examples = [json_encode_field(example, field_path) for example in examples]
            encoded = "\n".join(json.dumps(example) for example in examples).encode()


def _merged(a, b, field: list, json_paths: list):
    """One arrow type for a field typed `a` in some chunks and `b` in another: structs gain each other's
    fields, null takes the other's type, ints widen to floats; values of different kinds (or a field
    in `json_paths`) are read as JSON text (datasets' Json feature), as datasets does in its first chunk."""
    import pyarrow as pa

    if field in json_paths:
        return pa.json_()
    if a == b or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        fields = {f.name: f.type for f in a}
        for f in b:
            fields[f.name] = (
                _merged(fields[f.name], f.type, field + [f.name], json_paths)
                if f.name in fields
                else f.type
            )
        return pa.struct(list(fields.items()))
    if pa.types.is_list(a) and pa.types.is_list(b):
        return pa.list_(_merged(a.value_type, b.value_type, field + [0], json_paths))
    if all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in (a, b)):
        return pa.float64()
    json_paths.append(field)
    return pa.json_()


def _json_lines_features(path: Path):
    """The columns of every record of a JSON-lines file, typed chunk by chunk (one chunk in memory at a
    time): datasets types them from its first chunk and then refuses a field that first appears later."""
    import datasets
    import pyarrow as pa

    merged, json_paths, line = pa.struct([]), [], 1
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            chunk += f.readline()  # whole lines
            if line == 1:
                chunk = chunk.removeprefix(codecs.BOM_UTF8)
            merged = _merged(merged, _chunk_type(path, chunk, line, json_paths), [], json_paths)
            line += chunk.count(b"\n")
    return datasets.Features.from_arrow_schema(pa.schema(list(_as_json(merged, [], json_paths))))


def _as_json(t, field: list, json_paths: list):
    """`t` with the fields in `json_paths` typed JSON text (one may vary only in a chunk after the
    chunks that first typed it)."""
    import pyarrow as pa

    if field in json_paths:
        return pa.json_()
    if pa.types.is_struct(t):
        return pa.struct([(f.name, _as_json(f.type, field + [f.name], json_paths)) for f in t])
    if pa.types.is_list(t):
        return pa.list_(_as_json(t.value_type, field + [0], json_paths))
    return t


def load_records(path: str | Path):
    """A `datasets.Dataset` of the records in a .jsonl/.json/.parquet file or a saved dataset folder.
    JSON lines whose fields vary past datasets' first 10 MB are typed over the whole file."""
    import datasets

    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(
            f"data not found: {path}",
            "pass a .jsonl, .json or .parquet file, a saved dataset folder, or `sharegpt`",
        )
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(
        datasets.logging.CRITICAL
    )  # its own error lines: ours says it once
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                split = "train" if "train" in loaded else next(iter(loaded))
                loaded = loaded[split]
            return loaded
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if builder is None:
            raise DataError(
                f"unsupported data file {path.name}",
                "use .jsonl, .json, .parquet or a folder saved with datasets' save_to_disk",
            )
        if _blank(path):  # datasets fails on it with an empty message
            raise DataError(
                f"{path} is empty: it holds no records",
                "pass a data file with one record per line (ShareGPT `conversations`, OpenAI "
                "`messages` or `text`)",
            )
        if not _utf8(path):  # pyarrow takes such bytes in, and a later read of the record fails
            raise DataError(
                f"{path}: {_not_utf8(path)} is not valid UTF-8",
                "fix or remove it (data files are read as UTF-8)",
            )
        if path.suffix == ".json" and path.stat().st_size <= 1 << 16 and _no_records(path):
            raise DataError(
                f"no records in {path}",
                "pass a file that holds conversations (a JSON list of records, or JSON lines)",
            )
        try:
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
        except (
            Exception
        ):  # e.g. a field first seen after datasets' first chunk: type every chunk's fields
            if builder != "json" or not _json_lines(path):
                raise
            loaded = datasets.load_dataset(
                builder, data_files=str(path), split="train", features=_json_lines_features(path)
            )
        if len(loaded) == 0:
            raise DataError(f"no records in {path}", "pass a file that holds conversations")
        return loaded
    except DataError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many types for unreadable files
        cause = exc.__cause__ or exc.__context__
        detail = (
            f"{exc} ({cause})" if cause is not None and str(cause) not in str(exc) else str(exc)
        )
        raise DataError(
            f"cannot read {path}: {' '.join(detail.split())}", READ_HINT
        ) from exc  # one line
    finally:
        datasets.logging.set_verbosity(verbosity)


def has_images(record: dict) -> bool:
    """An image-text record: OpenAI-style image content parts, or ShareGPT's `image` / `images` field."""
    if record.get("image") or record.get("images"):
        return True
    turns = record.get("messages") or record.get("conversations") or []
    contents = (
        [turn.get("content") for turn in turns if isinstance(turn, dict)]
        if isinstance(turns, list)
        else []
    )
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PARTS
        for content in contents
        if isinstance(content, list)
        for part in content
    )


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        texts = []
        for part in content:
            if (
                isinstance(part, dict)
                and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                return None
        return "".join(texts)
    return None


def normalise(record: dict, require_assistant: bool = True) -> tuple[str, Any]:
    """("chat", messages) | ("text", str) | ("skip", reason). `require_assistant=False` keeps chats
    without an assistant turn (prompts for `spec regenerate`)."""
    if has_images(
        record
    ):  # counted apart: a vision-language draft needs the images (not built yet)
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
        role = (
            turn.get(role_key)
            if turn.get(role_key) is not None
            else turn.get("role" if role_key == "from" else "from")
        )
        content = (
            turn.get(text_key)
            if turn.get(text_key) is not None
            else turn.get("content" if text_key == "value" else "value")
        )
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
