"""torch.compile of the draft's step on this machine: tokens/s eager against compiled, and what the
compilation costs.

    python bench/compile.py [--lengths 2048] [--steps 4] [--precision fp32,bf16]

bench/precision.py's step (SmolLM2-135M-shaped EAGLE-3 draft, draft vocab 8192, batch 1, 7 TTT steps,
forward and backward, clipping and AdamW under `spec train`'s autocast), run eager and then with the
draft's modules compiled by TorchInductor (`module.compile()` on each RMSNorm and MLP, the pieces that
are plain tensor code: the TTT attention is a custom autograd function over fused kernels and the loss
head one over the vocabulary, which a compiler can only cut around). Same weights and batch for both;
the first compiled step (compilation) is reported apart and the others timed (best of). Prints tokens/s
eager and compiled, their ratio, the compile time and the largest relative difference of the losses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def run(T: int, precision: str, steps: int, compiled: bool) -> tuple[float, float, list[float]]:
    """(tokens/s over the timed steps, seconds of the first step, losses)."""
    from precision import time_steps
    from train_step import build

    from spec_cli.draft.layers import MLP, RMSNorm

    torch._dynamo.reset()
    draft, batch = build(T)
    if compiled:
        for module in draft.modules():
            if isinstance(module, (MLP, RMSNorm)):
                module.compile()
    times, losses = time_steps(draft, batch, precision, steps)
    return T / min(times[1:]), times[0], losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--precision", default="fp32,bf16")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"{'T':>6} {'precision':>9} {'eager tok/s':>12} {'compiled tok/s':>15} {'ratio':>6} "
        f"{'first step eager / compiled s':>30} {'max loss diff':>14}"
    )
    for T in (int(x) for x in args.lengths.split(",")):
        for precision in args.precision.split(","):
            eager, first_eager, eager_losses = run(T, precision, args.steps, False)
            comp, first_comp, comp_losses = run(T, precision, args.steps, True)
            diff = max(abs(a - b) / abs(a) for a, b in zip(eager_losses, comp_losses))
            print(
                f"{T:>6} {precision:>9} {eager:>12.1f} {comp:>15.1f} {comp / eager:>5.2f}x "
                f"{first_eager:>14.1f} / {first_comp:<13.1f} {diff:>14.1e}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
