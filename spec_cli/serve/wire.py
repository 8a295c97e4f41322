"""The wire protocol of `spec serve-target`, shared by both sides (server.py, client.py): the
protocol version, the token variable, how a draft vocab is named, and the message format, safetensors
bytes + JSON.

A tensor message is a standard safetensors file held in memory:

    [8 bytes: header length N, little-endian u64][N bytes: JSON header][tensor data]

and its JSON metadata travels as one string in the header's `__metadata__` ({"json": "..."}), so one
body carries both. Nothing is ever unpickled. Everything else (info, errors, acknowledgements) is
plain JSON.

The encoder writes the tensors' bytes straight from their memory (a list of buffers, no joined copy);
the decoder checks every header field against the body before it builds a single tensor, and the
tensors it returns are views of the received buffer (no second copy).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from spec_cli.batch import CODES, DTYPES, MAX_TENSORS, check_shape  # noqa: F401 (re-exported)

PROTOCOL = 1  # bumped whenever a message changes meaning
TOKEN_ENV = "SPEC_SERVE_TOKEN"  # the token both sides read when none is passed
TENSOR_TYPE = "application/x-safetensors"
JSON_TYPE = "application/json"

MAX_HEADER_BYTES = 1 << 20


class WireError(ValueError):
    """A message that is not a well-formed tensor message (the server answers 400)."""


def vocab_id(selected_token_ids: torch.Tensor) -> str:
    """Names a draft vocab on the wire: the sha256 of its int64 ids."""
    ids = selected_token_ids.detach().to("cpu", torch.int64).contiguous()
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]


@dataclass
class Encoded:
    """A tensor message as buffers to write one after the other (no joined copy)."""

    parts: list  # bytes / memoryview
    nbytes: int

    def tobytes(self) -> bytes:
        return b"".join(bytes(p) for p in self.parts)


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is already contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def encode(tensors: dict[str, torch.Tensor], meta: dict | None = None) -> Encoded:
    """A safetensors message of `tensors` (moved to CPU) with `meta` as JSON metadata.

    Tensors are laid out widest dtype first so every tensor starts aligned to its element size.
    """
    cpu = {name: t.detach().cpu() for name, t in tensors.items()}
    order = sorted(cpu, key=lambda n: (-cpu[n].element_size(), n))
    header: dict = {"__metadata__": {"json": json.dumps(meta or {}, separators=(",", ":"))}}
    offset = 0
    parts = []
    for name in order:
        t = cpu[name]
        if t.dtype not in CODES:
            raise WireError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        parts.append(_raw(t))
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)  # the data section starts 8-aligned
    prefix = struct.pack("<Q", len(head)) + head
    return Encoded([prefix, *parts], len(prefix) + offset)


def _shape(name: str, value) -> list[int]:
    try:
        return check_shape(name, value)
    except ValueError as exc:
        raise WireError(str(exc)) from None


def decode(body: bytes | bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of a safetensors message, checked field by field before any tensor is
    built. Tensors are views into `body` when it is writable (a bytearray), else copies."""
    view = memoryview(body).cast("B")
    if len(view) < 8:
        raise WireError(f"a tensor message needs at least 8 bytes, got {len(view)}")
    (n,) = struct.unpack("<Q", view[:8])
    if n > MAX_HEADER_BYTES or n > len(view) - 8:
        raise WireError(
            f"header length {n} exceeds the message ({len(view)} bytes) or "
            f"the limit ({MAX_HEADER_BYTES} bytes)"
        )
    try:
        header = json.loads(bytes(view[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("the header must be a JSON object")
    raw_meta = header.pop("__metadata__", None) or {}
    if not isinstance(raw_meta, dict) or not all(isinstance(v, str) for v in raw_meta.values()):
        raise WireError("__metadata__ must map strings to strings")
    try:
        meta = json.loads(raw_meta.get("json", "{}"))
    except ValueError as exc:
        raise WireError(f"the JSON metadata does not parse: {exc}") from None
    if not isinstance(meta, dict):
        raise WireError("the JSON metadata must be an object")
    if len(header) > MAX_TENSORS:
        raise WireError(f"{len(header)} tensors in one message (at most {MAX_TENSORS})")
    data_start, data_len = 8 + n, len(view) - 8 - n
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise WireError(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
        if entry["dtype"] not in DTYPES:
            raise WireError(f"tensor {name!r}: unknown dtype {entry['dtype']!r}")
        shape = _shape(name, entry["shape"])
        offsets = entry["data_offsets"]
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise WireError(f"tensor {name!r}: data_offsets must be two integers")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        itemsize = DTYPES[entry["dtype"]].itemsize
        if not 0 <= begin <= end <= data_len or end - begin != numel * itemsize:
            raise WireError(
                f"tensor {name!r}: data_offsets {offsets} do not match shape {shape} "
                f"x {itemsize} bytes within {data_len} data bytes"
            )
        spans.append((begin, end, name, DTYPES[entry["dtype"]], shape, numel))
    spans.sort()
    covered = 0
    for begin, end, name, *_ in spans:
        if begin != covered:
            raise WireError(f"tensor {name!r}: data overlaps another tensor or leaves a hole")
        covered = end
    if covered != data_len:
        raise WireError(f"{data_len - covered} trailing bytes after the last tensor")
    tensors = {}
    writable = not view.readonly
    for begin, end, name, dtype, shape, numel in spans:
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        chunk = view[data_start + begin : data_start + end]
        if writable:
            t = torch.frombuffer(chunk, dtype=torch.uint8)
            t = (
                t.view(dtype)
                if (data_start + begin) % dtype.itemsize == 0
                else t.clone().view(dtype)
            )
        else:
            t = torch.frombuffer(bytearray(chunk), dtype=dtype)
        tensors[name] = t.view(shape)
    return tensors, meta


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def loads(body: bytes | bytearray) -> dict:
    """A JSON object from a request body (WireError when it is not one)."""
    try:
        obj = json.loads(bytes(body).decode("utf-8")) if len(body) else {}
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"the body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError("the body must be a JSON object")
    return obj
