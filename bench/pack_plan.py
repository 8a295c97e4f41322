"""How long `--pack` takes to plan its rows: spec_cli's first fit (a tree of the rows' free room)
against a scan of every row for each sample, the same rows either way, at growing numbers of samples.

    python bench/pack_plan.py                 # 2k, 8k, 32k samples against the scan; then 1M alone

Lengths are drawn like a chat data set's (log-normal around 600 tokens, cut at --max-length 4096),
packed into rows of 8,192 tokens. The scan is quadratic in the samples (each one looks at every open
row), so it is timed only up to 32k samples.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from spec_cli.data.batching import plan_packed  # noqa: E402


def scanned(lengths: list[int], budget: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(max(budget - lengths[i], 0))
    return rows


def lengths_of(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n).log_normal_(mean=6.4, std=0.8, generator=g)
    return x.round().clamp(1, 4096).long()


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2000,8000,32000")
    ap.add_argument("--large", type=int, default=1_000_000)
    ap.add_argument("--row-tokens", type=int, default=8192)
    args = ap.parse_args()
    print("| samples | rows | tree s | scan s | scan / tree |\n|---|---|---|---|---|")
    for n in [int(s) for s in args.sizes.split(",") if s]:
        lengths = lengths_of(n)
        tree, t = timed(lambda: plan_packed(lengths, args.row_tokens))
        scan, s = timed(lambda: scanned(lengths.tolist(), args.row_tokens))
        assert tree == scan, n
        print(f"| {n:,} | {len(tree):,} | {t:.2f} | {s:.2f} | {s / t:.0f}x |", flush=True)
    if args.large:
        rows, t = timed(lambda: plan_packed(lengths_of(args.large), args.row_tokens))
        print(f"| {args.large:,} | {len(rows):,} | {t:.2f} | (not run) | |")


if __name__ == "__main__":
    main()
