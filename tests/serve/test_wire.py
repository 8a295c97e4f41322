"""The wire format is plain safetensors (+ JSON metadata), and a bad message never builds a tensor."""

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from spec_cli.serve import wire


def sample():
    gen = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=gen),
        "i64": torch.arange(7),
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.randn(2, 3, generator=gen).bfloat16(),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
    }


def test_encode_is_safetensors_and_decode_reads_safetensors():
    tensors = sample()
    encoded = wire.encode(tensors, {"vocab_id": "abc", "n": 3})
    body = encoded.tobytes()
    assert len(body) == encoded.nbytes
    for name, t in st_load(body).items():  # the reference library reads our bytes
        assert torch.equal(t, tensors[name]) and t.dtype == tensors[name].dtype, name
    decoded, meta = wire.decode(bytearray(body))
    assert meta == {"vocab_id": "abc", "n": 3}
    for name, t in tensors.items():
        assert torch.equal(decoded[name], t) and decoded[name].dtype == t.dtype, name
    decoded, meta = wire.decode(st_save(tensors))  # and we read the library's (read-only bytes)
    assert meta == {} and all(torch.equal(decoded[n], t) for n, t in tensors.items())


def message(header: dict, data: bytes = b"", length: int | None = None) -> bytearray:
    head = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(head) if length is None else length) + head + data)


BAD = [
    (bytearray(b"1234"), "at least 8 bytes"),
    (bytearray(struct.pack("<Q", 10**12) + b"{}"), "header length"),
    (message({}, length=1), "not JSON"),
    (bytearray(struct.pack("<Q", 4) + b"\xff\xfe{}"), "not JSON"),
    (message([1, 2]), "JSON object"),  # type: ignore[arg-type]
    (message({"__metadata__": {"json": 5}}), "strings to strings"),
    (message({"__metadata__": {"json": "{nope"}}), "does not parse"),
    (message({"__metadata__": {"json": "[1]"}}), "must be an object"),
    (message({"a": {"dtype": "F32", "shape": [2]}}), "exactly dtype, shape, data_offsets"),
    (
        message({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
        "unknown dtype",
    ),
    (
        message({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
        "non-negative",
    ),
    (
        message({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, b"\0" * 4),
        "non-negative",
    ),
    (
        message({"a": {"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}}, b"\0" * 4),
        "at most 8",
    ),
    (
        message({"a": {"dtype": "F32", "shape": [10**15], "data_offsets": [0, 4]}}, b"\0" * 4),
        "do not match",
    ),
    (
        message({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
        "do not match",
    ),
    (
        message({"a": {"dtype": "F32", "shape": [1], "data_offsets": ["0", 4]}}, b"\0" * 4),
        "two integers",
    ),
    (
        message(
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            },
            b"\0" * 8,
        ),
        "overlaps",
    ),
    (
        message({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 12),
        "trailing",
    ),
    (
        message(
            {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(65)}
        ),
        "tensors in one message",
    ),
]


@pytest.mark.parametrize("body, why", BAD, ids=[w for _, w in BAD])
def test_malformed_messages_are_refused(body, why):
    with pytest.raises(wire.WireError, match=why):
        wire.decode(body)
