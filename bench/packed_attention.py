"""Packed TTT attention: one causal kernel call per document (`Segments`) against the dense
[B, 1, T, T] block-causal bias, forward + backward, on SmolLM2-shaped heads.

    python bench/packed_attention.py [--row 2048] [--doc 234] [--steps 3] [--repeats 5]

A row of --row slots holds documents of about --doc tokens (the demo's packed rows: 2048 slots,
~234 tokens per regenerated conversation); each TTT step adds one extra key per position, as in
training. Both representations are first checked to give the same outputs and gradients; the table
gives the median seconds per (forward + backward) over all steps and the ratio dense / segments.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from spec_cli.draft.attention import Segments, block_causal_bias, ttt_attention  # noqa: E402


def doc_lengths(row: int, doc: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths, used = [], 0
    while used < row:
        n = int(torch.randint(doc // 2, doc * 3 // 2 + 1, (1,), generator=gen))
        n = min(n, row - used)
        lengths.append(n)
        used += n
    return torch.tensor([lengths])


def one_pass(bias, q, k0, v0, extra, steps):
    grads = []
    for n in range(steps):  # TTT step n attends the step-0 prefix plus n extra keys per position
        out = ttt_attention(q, k0, v0, extra[0][:n], extra[1][:n], bias)
        grads.append(torch.autograd.grad(out.square().sum(), [q, k0, v0]))
    return grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", type=int, default=2048)
    parser.add_argument("--doc", type=int, default=234)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    heads, kv_heads, d = 9, 3, 64  # SmolLM2-135M
    seq_lens = doc_lengths(args.row, args.doc, seed=0)
    gen = torch.Generator().manual_seed(0)

    def rand(h):
        return torch.randn(1, h, args.row, d, generator=gen).requires_grad_()

    q, k0, v0 = rand(heads), rand(kv_heads), rand(kv_heads)
    extra = ([rand(kv_heads) for _ in range(args.steps)], [rand(kv_heads) for _ in range(args.steps)])
    variants = {"dense bias": block_causal_bias(seq_lens, args.row, torch.float32),
                "segments": Segments.from_seq_lens(seq_lens, args.row)}

    ref = one_pass(variants["dense bias"], q, k0, v0, extra, args.steps)
    got = one_pass(variants["segments"], q, k0, v0, extra, args.steps)
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)

    seconds = {}
    for name, bias in variants.items():
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            one_pass(bias, q, k0, v0, extra, args.steps)
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times)
    docs = seq_lens.shape[1]
    print(f"row {args.row} slots, {docs} documents (mean {args.row / docs:.0f}), TTT {args.steps}, "
          f"{torch.get_num_threads()} threads; outputs and gradients agree")
    print("| attention | s per fwd+bwd (all steps) |")
    print("| --- | --- |")
    for name, s in seconds.items():
        print(f"| {name} | {s:.3f} |")
    print(f"ratio dense / segments: {seconds['dense bias'] / seconds['segments']:.2f}x")


if __name__ == "__main__":
    main()
