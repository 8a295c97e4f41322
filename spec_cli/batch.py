"""What every target backend returns for one batch: the draft's inputs and its supervision.

The one contract every part shares (target backends, the server and its client, streaming, the
draft's TTT loss), so it sits at the top of the package and imports nothing from spec_cli.

Alignment (docs/eagle.md, "Supervision: alignment"): aux hidden states stay position-aligned; input_ids, loss_mask and everything
derived from the target's logits are shifted left by one, so at position t the draft sees the target's
state after token t together with token t+1, and learns the target's distribution for token t+2.
The last position of each row, which has nothing to shift in, is padding (loss_mask 0).
Packing metadata (position_ids, seq_lens) is carried through unshifted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

EXTRA = "extra."  # the prefix of an extra field's name in a flat dict of tensors
MAX_TENSORS = 64  # tensors in one message or transfer
MAX_DIMS = 8
# safetensors' dtype codes: how every message and transfer names a tensor's dtype
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


def check_shape(name: str, value) -> list[int]:
    """`value` as a tensor's shape (ValueError naming the tensor when it is not one)."""
    if (
        not isinstance(value, list)
        or len(value) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)
    ):
        raise ValueError(
            f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} non-negative integers"
        )
    return value


def tensor_header(tensors: dict[str, torch.Tensor]) -> list[list]:
    """Tensors described without their data, [[name, dtype code, shape], ...] in order: what a transfer
    of them sends first (JSON), so the receiver can allocate each."""
    return [[name, CODES[t.dtype], list(t.shape)] for name, t in tensors.items()]


def parse_tensor_header(entries) -> list[tuple[str, torch.dtype, list[int]]]:
    """`tensor_header()`'s output, checked entry by entry (ValueError on anything else)."""
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise ValueError(f"the tensor list must be a list of at most {MAX_TENSORS} entries")
    out, names = [], set()
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise ValueError("each tensor entry must be [name, dtype, shape]")
        name, code, shape = entry
        if name in names:
            raise ValueError(f"tensor {name!r} is listed twice")
        if code not in DTYPES:
            raise ValueError(f"tensor {name!r}: unknown dtype {code!r}")
        names.add(name)
        out.append((name, DTYPES[code], check_shape(name, shape)))
    return out


@dataclass
class TargetBatch:
    aux_hidden: (
        torch.Tensor
    )  # [B, T, n*H] target dtype, position-aligned (n aux layers: the algorithm's)
    input_ids: torch.Tensor  # [B, T] long, shifted: input_ids[:, t] = x[t+1]
    attention_mask: torch.Tensor  # [B, T] long, unshifted (1 = real token)
    loss_mask: torch.Tensor  # [B, T] long, shifted like input_ids
    target_p: torch.Tensor  # [B, T, Vd] fp32: softmax of the target's logits over the draft vocab
    position_mask: torch.Tensor  # [B, T] bool: t2d[target argmax] & loss_mask
    target_ids: torch.Tensor  # [B, T] long: the target's argmax (a target-vocab id)
    target_mass: torch.Tensor  # [B, T] fp32: draft-vocab mass under the full-vocab normaliser
    position_ids: torch.Tensor | None = (
        None  # [B, T] long, unshifted (packing: restart per document)
    )
    seq_lens: torch.Tensor | None = None  # [B, max_docs] long, unshifted (packing)
    # [B, T, H] target dtype, position-aligned: the target's last hidden state after its final norm
    # (what lm_head reads; EAGLE-1/2's feature). Only when the backend was asked (`keep_final_hidden`).
    final_hidden: torch.Tensor | None = None
    # name -> [B, T, W], position-aligned: the per-token fields of the target an algorithm asked for
    # (Algorithm.needs, computed by its TargetField); only those the backend was asked for
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # [n] long: under context parallelism, a batch read for one rank holds only the slots of its rows it
    # needs, these row indices in this order (ranges, back to back); every field but attention_mask,
    # position_ids and seq_lens (whole rows) is then [B, n, ...]. None: whole rows.
    slots: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TargetBatch:
        """Every tensor on `device`; non_blocking: from pinned host memory, the host does not wait."""
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TargetBatch:
        """Every tensor in page-locked host memory (a copy), so that `.to(cuda, non_blocking=True)` does
        not make the host wait."""
        return self.map(lambda t: t.pin_memory())

    def map(self, fn) -> TargetBatch:
        """The batch with `fn` applied to every tensor, extras included."""
        moved = {
            f.name: fn(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved, extras={k: fn(v) for k, v in self.extras.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, flat (the extras as `extra.NAME`): what the wire and the stream carry."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return out | {EXTRA + name: t for name, t in self.extras.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> TargetBatch:
        """The batch `tensors()` flattened."""
        extras = {k[len(EXTRA) :]: v for k, v in tensors.items() if k.startswith(EXTRA)}
        return cls(**{k: v for k, v in tensors.items() if not k.startswith(EXTRA)}, extras=extras)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def batch_nbytes(
    rows: int,
    length: int,
    hidden: int,
    aux_layers: int,
    draft_vocab: int,
    target_dtype: torch.dtype,
    final_hidden: bool = False,
    extra_widths: tuple[int, ...] = (),
    docs: int = 0,
) -> int:
    """Bytes of the tensors of a [rows, length] TargetBatch as a backend makes it, each field in the dtype
    written above (an extra field in the target's dtype); `docs`: a packed batch's documents per row
    (seq_lens [rows, docs]; 0 when not packed). `spec train --stream` sizes its store with it (a test
    holds it to the nbytes of a real batch)."""
    wide = aux_layers * hidden + (hidden if final_hidden else 0) + sum(extra_widths)  # target dtype
    per_token = (
        wide * target_dtype.itemsize
        + 4 * draft_vocab  # target_p fp32
        + 4 * 8  # input_ids, attention_mask, loss_mask, target_ids: long
        + 1
        + 4
    )  # position_mask bool, target_mass fp32
    return rows * length * per_token + 8 * rows * docs  # + seq_lens, long
