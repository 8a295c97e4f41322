"""Peak memory and FLOPs of a real training step, measured without running it: the step runs on fake
tensors (torch's FakeTensorMode: shapes, dtypes and devices, no data, no memory), on any machine,
and a dispatch mode adds up the bytes of the storages alive after each op.

What it counts: every tensor the step holds (parameters, gradients, optimizer state, the batch,
activations saved for backward, op outputs while alive), at the op granularity. What it cannot see:
an op's internal scratch (a fused kernel's workspace), the CUDA caching allocator's rounding and
fragmentation, the CUDA context (about 0.5-1 GB per process) and NCCL's buffers; `spec plan` adds a
stated margin for them. A CPU run's allocator peak agrees with it within 2% (tests/plan/test_memory.py).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the distinct storages alive, now and at their peak, for tensors made under the mode
    and those handed to `track` (what existed before: weights, the batch)."""

    def __init__(self):
        super().__init__()
        self.now = 0
        self.peak = 0
        self._live: dict[int, weakref.ref] = {}

    def track(self, *tensors) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._add(t)

    def reset_peak(self) -> None:
        self.peak = self.now

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._live and self._live[key]() is storage:
            return
        size = storage.nbytes()
        self.now += size
        self.peak = max(self.peak, self.now)
        self._live[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))

    def _free(self, key: int, size: int) -> None:
        self.now -= size
        self._live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def fake_weights(module: nn.Module, device: torch.device) -> nn.Module:
    """Give `module` (built on the meta device) empty weights and buffers on `device`, in place: under
    FakeTensorMode they are fake tensors of that device. requires_grad is kept."""
    for mod in module.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(
                mod,
                name,
                nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device),
                    requires_grad=p.requires_grad,
                ),
            )
        for name, b in list(mod.named_buffers(recurse=False)):
            mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return module
