"""Counting supervised tokens: spec_cli's vectorised bincount vs a collections.Counter baseline.

    python bench/vocab_count.py [--tokens 2000000]

Prints tokens/s of both, measured in the same run, and the ratio.
"""

import argparse
import time
from collections import Counter

import torch

from spec_cli.artifacts.tokens import TokenizedData
from spec_cli.stages.build_vocab_map import count_supervised


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    ids = (torch.rand(args.tokens, generator=gen) ** 4 * args.vocab).to(torch.int32)
    mask = (torch.rand(args.tokens, generator=gen) < 0.7).to(torch.uint8)
    data = TokenizedData(ids, mask, torch.tensor([0, args.tokens]), torch.tensor([0]))

    t0 = time.perf_counter()
    counts = count_supervised(data, args.vocab)
    fast = time.perf_counter() - t0

    t0 = time.perf_counter()
    baseline = Counter(i for i, m in zip(ids.tolist(), mask.tolist()) if m)
    slow = time.perf_counter() - t0

    assert all(counts[i] == c for i, c in baseline.items())
    print(f"tokens: {args.tokens}")
    print(f"spec_cli bincount : {args.tokens / fast:14,.0f} tokens/s ({fast:.3f} s)")
    print(f"Counter baseline  : {args.tokens / slow:14,.0f} tokens/s ({slow:.3f} s)")
    print(f"ratio (spec_cli / baseline): {slow / fast:.1f}x")


if __name__ == "__main__":
    main()
