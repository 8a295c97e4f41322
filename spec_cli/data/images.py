"""Images in chat records: where a record puts them, how they open, and the check made before a stage
writes anything (docs/vlm.md).

Where an image can be:
- OpenAI-style content parts: {"type": "image_url", "image_url": {"url": U}} (or the URL as a string),
  {"type": "image", "image": U} (or "url" / "path"), {"type": "input_image", "image_url": U};
- ShareGPT: the record's "image": U or "images": [U, ...], placed where the turns' text says "<image>"
  (in order); a record whose text has no "<image>" gets its images before the first user turn's text
  (LLaVA's data convention). A count of markers other than the count of images is an error.

U is a local path (relative to the data file's folder, or absolute; "file://" allowed), a data URL
("data:image/png;base64,..."), or bare base64. Remote URLs are refused: training data is read
offline, so download the images first and point at the files.

Every image is opened in full (a truncated file fails here, not in the middle of a run) and converted
to RGB, as the targets' image processors take it.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path

from spec_cli.errors import DataError

MARKER = "<image>"  # ShareGPT's image placeholder in a turn's text
_PART_TYPES = ("image", "image_url", "input_image")
_REMOTE = ("http://", "https://", "s3://", "gs://")


@dataclass(frozen=True)
class ImageRef:
    source: str  # as the record gives it (a path, a data URL, base64)
    where: str  # its place in the record, for messages: 'messages[0].content[1]', 'images[2]'


def _part_source(part: dict) -> str | None:
    value = (
        part.get("image_url")
        if part.get("type") in ("image_url", "input_image")
        else (part.get("image") or part.get("url") or part.get("path"))
    )
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) and value else None


def _turns(record: dict) -> tuple[str, list] | None:
    for key in ("messages", "conversations"):
        if isinstance(record.get(key), list):
            return key, record[key]
    return None


def _text_of(turn: dict):
    return turn.get("content") if turn.get("content") is not None else turn.get("value")


def image_refs(record: dict) -> list[ImageRef]:
    """The record's images in the order they appear to the model; DataError for a malformed reference
    (a part with no source, a marker count that differs from the images given)."""
    refs: list[ImageRef] = []
    found = _turns(record)
    key, turns = found if found is not None else ("messages", [])
    for t, turn in enumerate(turns):
        content = _text_of(turn) if isinstance(turn, dict) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in _PART_TYPES:
                source = _part_source(part)
                if source is None:
                    raise DataError(
                        f"{key}[{t}].content[{p}] is an image part without an image",
                        'give it {"type": "image_url", "image_url": {"url": PATH}} or '
                        '{"type": "image", "image": PATH}',
                    )
                refs.append(ImageRef(source, f"{key}[{t}].content[{p}]"))
    listed = (
        record.get("images")
        if record.get("images") is not None
        else ([record["image"]] if record.get("image") is not None else [])
    )
    if isinstance(listed, str):
        listed = [listed]
    if not isinstance(listed, list) or not all(isinstance(x, str) and x for x in listed):
        raise DataError(
            "the record's image / images field is not a path or a list of paths",
            'write "images": ["a.png", ...]',
        )
    if listed:
        field = "images" if record.get("images") is not None else "image"
        markers = sum(
            _text_of(turn).count(MARKER)
            for turn in turns
            if isinstance(turn, dict) and isinstance(_text_of(turn), str)
        )
        if markers and markers != len(listed):
            raise DataError(
                f"the record's text has {markers} {MARKER} marker(s) for {len(listed)} image(s)",
                f"put one {MARKER} where each image goes, or none (all before the first user turn)",
            )
        refs.extend(ImageRef(source, f"{field}[{i}]") for i, source in enumerate(listed))
    return refs


def _decode_base64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def image_bytes(source: str, base: Path | None) -> bytes:
    """The encoded image a source names: a data URL or base64 decoded, a path read (relative to `base`)."""
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header or (data := _decode_base64(payload)) is None:
            raise DataError(
                f"the data URL {source[:40]}... is not base64 image data",
                "write data:image/png;base64,<the file's bytes in base64>",
            )
        return data
    if source.startswith(_REMOTE):
        raise DataError(
            f"the image {source!r} is remote; spec_cli reads training data offline",
            "download the images and give their local paths (relative to the data file)",
        )
    if (
        len(source) > 256 and (data := _decode_base64(source)) is not None
    ):  # bare base64, not a path
        return data  # (a path this long would fail the OS's name limits before it was looked for)
    path = Path(source[len("file://") :] if source.startswith("file://") else source).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    try:
        if path.is_file():
            return path.read_bytes()
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte
        raise DataError(
            f"the image {source[:60]!r} is not a readable file: {exc}",
            "give a path relative to the data file's folder, an absolute path, or a data URL",
        ) from None
    raise DataError(
        f"the image {source!r} is not a file"
        + (f" (looked for {path})" if path.as_posix() != source else ""),
        "give a path relative to the data file's folder, an absolute path, or a data URL",
    )


def open_image(source: str, base: Path | None = None):
    """The image as RGB (PIL), read in full; DataError naming the source when it cannot be."""
    return decode_image(image_bytes(source, base), source)


def decode_image(data: bytes, source: str):
    """Encoded image bytes as RGB (PIL), decoded in full; DataError naming `source` when they cannot be."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decode it all now: a truncated file fails here
            return image.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as exc:
        shown = source if len(source) <= 80 else source[:60] + "..."
        raise DataError(
            f"the image {shown!r} cannot be read: {exc}",
            "check the file is a PNG, JPEG, WebP or GIF image that opens",
        ) from None


def check_images(records, base: Path | None, limit: int = 5, digest=None) -> int:
    """Open every image of every record (`records`: an iterable of dicts, e.g. a datasets.Dataset) before
    a stage writes anything. Returns the number of images; raises one DataError naming the first
    `limit` records whose images are missing, unreadable or malformed (record index and place).
    `digest` (a hashlib object) is fed every image's bytes in order: the images' fingerprint."""
    problems, count = [], 0
    for index, record in enumerate(records):
        try:
            refs = image_refs(record)
            for ref in refs:
                try:
                    data = image_bytes(ref.source, base)
                    decode_image(data, ref.source)
                    if digest is not None:
                        digest.update(len(data).to_bytes(8, "little") + data)
                except DataError as exc:
                    raise DataError(f"{ref.where}: {exc.message}", exc.hint) from None
            count += len(refs)
        except DataError as exc:
            problems.append((index, exc))
            if len(problems) > limit:
                break
    if problems:
        shown = "; ".join(f"record {i}: {exc.message}" for i, exc in problems[:limit])
        more = " (and more)" if len(problems) > limit else ""
        raise DataError(
            f"{len(problems[:limit])} record(s) with images that cannot be used{more}: {shown}",
            problems[0][1].hint,
        )
    return count
