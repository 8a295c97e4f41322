"""The target of `spec regenerate --features`: the feature cache is written by precompute's own code
(stages/precompute.py: the same tokenisation, batches, shards and identity as `spec precompute` of the
regenerated file), with this backend in place of a target forward. A row whose states regenerate kept
(the rows files, one per chunk) is read back; any other row runs in the live target engine.

A rows file (safetensors) holds, for its chunk's rows in order: `input_ids` [N] int32 (the rows one
after another), `offsets` [rows + 1] int64, and their states `hidden` [N, H] and `aux` [N, A] in the
model's dtype. A row is found by its exact token ids.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from spec_cli.artifacts.io import atomic_path


def write_rows(
    path: Path, rows: list[list[int]], hidden: list[torch.Tensor], aux: list[torch.Tensor]
) -> None:
    """One chunk's rows and their states [n_i, H] / [n_i, A], atomically."""
    from safetensors.torch import save_file

    lengths = [len(r) for r in rows]
    tensors = {
        "input_ids": torch.tensor([t for r in rows for t in r], dtype=torch.int32),
        "offsets": torch.cumsum(torch.tensor([0] + lengths, dtype=torch.int64), 0),
        "hidden": torch.cat(hidden).contiguous() if rows else torch.zeros(0),
        "aux": torch.cat(aux).contiguous() if rows else torch.zeros(0),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


class ReplayBackend:
    """`live` (a LocalTargetBackend) for everything but run_target, which reads kept rows back."""

    def __init__(self, live, files: list[Path]):
        self.live = live
        self.replayed = self.computed = 0  # rows
        self._files = [safe_open(str(f), framework="pt") for f in files]
        self._index: dict[tuple[int, ...], tuple[int, int, int]] = {}  # ids -> (file, start, stop)
        for i, f in enumerate(self._files):
            ids, offsets = f.get_tensor("input_ids").tolist(), f.get_tensor("offsets").tolist()
            for lo, hi in zip(offsets, offsets[1:]):
                self._index[tuple(ids[lo:hi])] = (i, lo, hi)

    def __getattr__(self, name):  # everything precompute asks of a target but its forward
        return getattr(self.__dict__["live"], name)

    def __setattr__(self, name, value):
        if name in ("live", "replayed", "computed", "_files", "_index"):
            object.__setattr__(self, name, value)
        else:  # e.g. precompute's extra_fields: the live backend computes the fields
            setattr(self.live, name, value)

    @torch.no_grad()
    def run_target(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, A], final hidden [B, T, H]) as the live backend gives them, zero at padding."""
        if (
            position_ids is not None or seq_lens is not None or kwargs
        ):  # packed or image rows: not kept
            self.computed += input_ids.shape[0]
            return self.live.run_target(input_ids, attention_mask, position_ids, seq_lens, **kwargs)
        B, T = input_ids.shape
        H = self.live.info["hidden_size"]
        A = len(self.live.aux_layers) * H
        device, dtype = self.live.device, self.live.dtype
        aux = torch.zeros(B, T, A, dtype=dtype, device=device)
        hidden = torch.zeros(B, T, H, dtype=dtype, device=device)
        lengths = attention_mask.long().sum(1).tolist()
        missing = []
        for b, n in enumerate(lengths):
            where = self._index.get(tuple(input_ids[b, :n].tolist()))
            if where is None or not bool(attention_mask[b, :n].all()):
                missing.append(b)
                continue
            f, lo, hi = where
            file = self._files[f]
            hidden[b, :n] = file.get_slice("hidden")[lo:hi].to(device, dtype)
            aux[b, :n] = file.get_slice("aux")[lo:hi].to(device, dtype)
        if missing:
            rows = torch.tensor(missing)
            a, h = self.live.run_target(input_ids[rows], attention_mask[rows])
            aux[rows.to(device)], hidden[rows.to(device)] = a.to(dtype), h.to(dtype)
        self.replayed += B - len(missing)
        self.computed += len(missing)
        return aux, hidden

    def close(self) -> None:  # the live backend belongs to whoever opened it
        self._files.clear()
