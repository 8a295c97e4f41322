"""spec train's step in fp32 and in bf16 autocast on this machine's CPU: tokens/s and the loss curve.

    python bench/precision.py [--lengths 2048,8192] [--steps 4]

SmolLM2-135M-shaped EAGLE-3 draft (bench/train_step.py's shape: H 576, draft vocab 8192), batch 1,
random inputs, 7 TTT steps, the trainer's own step (draft/step.py: forward and backward, clipping,
AdamW) under `trainer.device.autocast` as `spec train --precision fp32|bf16` runs it. Both precisions
start from the same weights and batch; the first step of each is a warm-up, the others are timed
(best of). Prints tokens/s per precision, bf16 / fp32, and the largest relative difference of the
losses along the run. What `--precision auto` picks here: bf16 where this CPU runs it natively
(spec_cli.targets.loading.fast_bf16), fp32 elsewhere.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def run(T: int, precision: str, steps: int) -> tuple[float, list[float]]:
    from train_step import build

    draft, batch = build(T)
    times, losses = time_steps(draft, batch, precision, steps)
    return T / min(times[1:]), losses


def time_steps(draft, batch, precision: str, steps: int) -> tuple[list[float], list[float]]:
    """`steps` training steps of `draft` on `batch` as spec train runs them at --precision `precision`:
    (seconds of each, loss of each)."""
    from spec_cli.draft.eagle3.ttt import ttt_forward
    from spec_cli.draft.step import forward_backward, make_optimizer, optimizer_step
    from spec_cli.trainer.device import autocast

    objective = SimpleNamespace(plan=lambda b: [None])
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, SimpleNamespace(lr=1e-4, weight_decay=0.0))
    dtype = torch.bfloat16 if precision == "bf16" else None
    cpu = torch.device("cpu")
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        out = forward_backward(
            objective,
            lambda b, unit: ttt_forward(draft, b, ttt_steps=7),
            batch,
            1,
            autocast(cpu, dtype),
        )
        optimizer_step(params, optimizer, 1.0)
        times.append(time.perf_counter() - start)
        losses.append(float(out.loss.detach()))
    return times, losses


def main(argv: list[str] | None = None) -> int:
    from spec_cli.targets.loading import fast_bf16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    native = fast_bf16(torch.device("cpu"))
    print(
        f"CPU bf16 native: {native} (--precision auto picks {'bf16' if native else 'fp32'}); "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'T':>6} {'fp32 tok/s':>11} {'bf16 tok/s':>11} {'bf16/fp32':>9} {'max loss diff':>14}")
    for T in (int(x) for x in args.lengths.split(",")):
        fp32, fp32_losses = run(T, "fp32", args.steps)
        bf16, bf16_losses = run(T, "bf16", args.steps)
        diff = max(abs(a - b) / abs(a) for a, b in zip(fp32_losses, bf16_losses))
        print(f"{T:>6} {fp32:>11.1f} {bf16:>11.1f} {bf16 / fp32:>8.2f}x {diff:>14.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
