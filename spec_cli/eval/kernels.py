"""The target's linear layers in the PyTorch evaluator on CPU: each on the faster of two kernels for every
token count decoding runs through it.

Why. Speculative decoding verifies a chain of k drafts in one forward over k + 1 tokens, and pays off
when that forward costs little more than one token's. PyTorch's CPU linear (MKL's sgemm on fp32) does
not behave so: on 2 Xeon cores its cost for the SmolLM2 head (49,152 x 576) is flat over 1-3 rows and
doubles at 4 (6.9 / 7.1 / 7.8 / 13.8 ms on one thread), the MLP's projections likewise (0.12 ms for
1-3 rows, 0.23 at 4), so a chain of 3 pays for its fourth token as much as for a second target step.
oneDNN's linear on weights packed once for it (`torch.ops.mkldnn._linear_pointwise`, what
torch.compile's CPU backend and vLLM's CPU build run) costs about the same for 1-4 rows, but carries a
fixed overhead that loses on small matrices at one row. Which wins depends on the CPU (AMX, AVX-512,
AVX2), the matrix and the row count, so it is measured here, on this machine, per weight shape and per
row count, before decoding (about 2 s for SmolLM2, more for a larger model or vocabulary); a kernel is
kept only where it is at least `MARGIN` faster, so that timing noise does not flip choices.

Both the target alone and the speculative decoder run the same modules, so the baseline gets the same
choice at one token that verification gets at k + 1: the speed-up compares two decodings on the best
kernels this evaluator has, not a handicapped baseline. The kernels round differently (a few 1e-6 on
fp32 logits), as MKL's one-row and many-row paths already do, so a near-tie between two tokens can
in principle resolve differently; `spec eval` checks every greedy turn against the target alone
(`identical`) and says where they part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MARGIN = 0.9  # packed must take at most this fraction of the default's time to be chosen
MEMORY_SHARE = 0.5  # packed copies may take at most this share of the memory available when choosing
REPEATS = 9  # timed calls per kernel, shape and row count (the median counts)
DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class KernelChoice:
    """What `choose` decided: per weight shape (out x in), the row counts run on packed weights."""
    rows: list[int]
    packed: dict[str, list[int]] = field(default_factory=dict)  # "out x in" -> row counts
    milliseconds: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # -> n -> [default, packed]
    modules: int = 0  # linear layers that run packed at some row count
    skipped: list[str] = field(default_factory=list)  # shapes faster packed, left out for memory
    refused: dict[str, str] = field(default_factory=dict)  # shapes oneDNN would not run: why

    def text(self) -> str:
        if not self.packed:
            return f"the target's linear layers: PyTorch's default kernel at {self._counts()} tokens (measured fastest)"
        shapes = "; ".join(f"{shape} at {','.join(map(str, n))}" for shape, n in self.packed.items())
        left = f"; not packed for lack of memory: {', '.join(self.skipped)}" if self.skipped else ""
        return (f"the target's linear layers on oneDNN packed weights where measured faster ({self.modules} "
                f"layers: {shapes} tokens), else PyTorch's default{left}")

    def _counts(self) -> str:
        return ",".join(map(str, self.rows))

    def to_json(self) -> dict:
        return {"rows": self.rows, "packed": self.packed, "milliseconds": self.milliseconds,
                "skipped_for_memory": self.skipped, "refused": self.refused}


def supported(model: nn.Module) -> str | None:
    """Why the packed kernel cannot run for this model here, or None."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    device = next(model.parameters()).device
    if device.type != "cpu":
        return f"the target is on {device.type} (the choice is between CPU kernels)"
    return None


def _dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs on this CPU (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    return DTYPES if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def _median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[REPEATS // 2]


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _run_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def available_bytes() -> int | None:
    """Memory this process can still take (Linux): MemAvailable (free plus reclaimable page cache, which
    loading the weights has just filled), capped by the cgroup's limit less its use; None where unknown."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = int(next(line.split()[1] for line in meminfo.splitlines()
                             if line.startswith("MemAvailable:"))) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:  # cgroup v2 (a container's limit)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available


@torch.no_grad()
def choose(model: nn.Module, rows: list[int], memory: int | None = None) -> KernelChoice:
    """Time both kernels for every weight shape of the model's linear layers (fp32 / bf16) at each row
    count in `rows`, and make each layer run packed at the counts where that is at least MARGIN faster.
    Other counts (a prompt's prefill) keep PyTorch's default. A packed copy sits beside each chosen
    layer's weight: the shapes that save the most time per byte go first, within MEMORY_SHARE of
    `memory` (default: what the system has free). Undo with `restore(model)`."""
    choice = KernelChoice(sorted(set(rows)))
    layers: dict[tuple, list[nn.Linear]] = {}
    dtypes = _dtypes()
    for module in model.modules():  # plain linears only: a subclass's or a hook's own forward is kept
        if type(module) is nn.Linear and module.weight.dtype in dtypes and "forward" not in module.__dict__:
            key = (*module.weight.shape, module.weight.dtype, module.bias is not None)
            layers.setdefault(key, []).append(module)
    gen = torch.Generator().manual_seed(0)
    wins = []  # (saving per byte, bytes, name, modules, counts)
    for (out_features, in_features, dtype, _), modules in layers.items():
        sample = modules[0]
        name = f"{out_features}x{in_features}"
        fast, times, saved = [], {}, 0.0
        try:
            packed = _packed(sample.weight)
            for n in choice.rows:
                x = torch.randn(1, n, in_features, generator=gen).to(dtype)
                plain = _median_ms(lambda x=x, w=sample.weight, b=sample.bias: F.linear(x, w, b))
                onednn = _median_ms(lambda x=x, w=packed, b=sample.bias: _run_packed(x, w, b))
                times[n] = [round(plain, 4), round(onednn, 4)]
                same = torch.allclose(_run_packed(x, packed, sample.bias).float(),
                                      F.linear(x, sample.weight, sample.bias).float(), rtol=1e-2, atol=1e-3)
                if same and onednn <= MARGIN * plain:
                    fast.append(n)
                    saved += plain - onednn
        except RuntimeError as exc:  # oneDNN refused this shape or dtype here: PyTorch's own kernel
            choice.refused[name] = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            continue
        choice.milliseconds[name] = times
        if fast:
            size = sum(m.weight.numel() * m.weight.element_size() for m in modules)
            wins.append((saved * len(modules) / size, size, name, modules, fast))
    budget = MEMORY_SHARE * (memory if memory is not None else (available_bytes() or 0))
    for _, size, name, modules, fast in sorted(wins, key=lambda w: -w[0]):
        if size > budget:
            choice.skipped.append(name)
            continue
        budget -= size
        choice.packed[name] = fast
        for module in modules:
            _install(module, _packed(module.weight), set(fast))
        choice.modules += len(modules)
    return choice


def _install(module: nn.Linear, packed: torch.Tensor, counts: set[int]) -> None:
    """module.forward runs the packed weights for CPU inputs of `counts` rows without autograd, else
    nn.Linear's own. (A deep copy of the model would keep calling the original module's weights.)"""
    plain = nn.Linear.forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if (not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == module.weight.dtype
                and module.weight.device.type == "cpu" and x.numel() // x.shape[-1] in counts):
            return _run_packed(x, packed, module.bias)
        return plain(x)
    module.forward = forward
    module._spec_packed = packed  # (kept with the module; `restore` drops both)


def restore(model: nn.Module) -> None:
    """Every linear layer `choose` changed back on nn.Linear.forward."""
    for module in model.modules():
        if "_spec_packed" in module.__dict__:
            del module.forward
            del module._spec_packed
