"""Host syncs in one training step, counted on CPU (each one drains the GPU's queue on CUDA).

    python bench/host_syncs.py

Runs EAGLE-3's TTT forward and backward (`ttt_forward`) on a tiny draft and batch under a
TorchDispatchMode that counts the ops which make the host wait for the device:
`_local_scalar_dense` (.item(), float(), bool(), int() of a tensor), `.tolist()`, `nonzero` and
boolean-mask indexing (their output size is data). Prints the count for TTT depths and documents per
row, so the ones that grow with either stand out. The training loop adds its own per micro-batch
(spec_cli/trainer/loop.py: float(loss) for the non-finite check, the metrics' copies to the host).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYNCING = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.index.Tensor_bool",
    "aten.unique",
    "aten._unique2",
    "aten.repeat_interleave.Tensor",
}


class CountSyncs(TorchDispatchMode):
    """Counts the ops whose result the host must wait for (by name), and device -> CPU copies."""

    def __init__(self, host_tensors=()):
        """host_tensors: tensors that live on the CPU on CUDA too (torch.optim's `step` counters, unless
        capturable or fused): reading them makes the host wait for nothing, so they are not counted."""
        super().__init__()
        self.counts: Counter = Counter()
        self.host = {id(t) for t in host_tensors}

    def __enter__(self):
        # .tolist() reads a CPU tensor's memory without dispatching an op (on CUDA it copies to the
        # host first): count it where it is called
        self._tolist = torch.Tensor.tolist
        counts, tolist = self.counts, self._tolist

        inside = []

        def counted(tensor, *args, **kwargs):
            if inside:  # a torch function mode (torch.device(...)) calls the method again: one call
                return tolist(tensor, *args, **kwargs)
            counts["tolist"] += 1
            inside.append(True)
            try:
                return tolist(tensor, *args, **kwargs)
            finally:
                inside.pop()

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = (
            str(func.overloadpacket)
            if not str(func).startswith("aten.index.Tensor")
            else "aten.index.Tensor"
        )
        if name == "aten._local_scalar_dense" and id(args[0]) in self.host:
            pass
        elif name in SYNCING:
            self.counts[name] += 1
        elif name == "aten.index.Tensor" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 else []) or []
        ):
            self.counts["aten.index.Tensor_bool"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def step_syncs(ttt_steps: int, docs: int) -> Counter:
    """Syncs of one EAGLE-3 TTT forward + backward on a [2, 64] batch of `docs` documents per row."""
    from spec_cli.draft.eagle3.ttt import ttt_forward
    from tests.draft import random_batch, tiny_draft

    draft = tiny_draft()
    T = 64
    seq_lens = None if docs == 1 else [[T // docs] * docs] * 2
    batch = random_batch(draft.config, [T, T], T, seq_lens)
    with CountSyncs() as mode:
        out = ttt_forward(draft, batch, ttt_steps=ttt_steps)
        out.loss.backward()
    return mode.counts


def main() -> int:
    print(f"{'TTT steps':>9} {'docs/row':>8} {'syncs':>6}  by op")
    for ttt_steps in (1, 3, 7):
        for docs in (1, 4, 8):
            counts = step_syncs(ttt_steps, docs)
            print(
                f"{ttt_steps:>9} {docs:>8} {sum(counts.values()):>6}  "
                + ", ".join(f"{k.replace('aten.', '')} {v}" for k, v in sorted(counts.items()))
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
