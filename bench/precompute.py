"""Precompute throughput and cache size on the real SmolLM2 target (CPU, fp32).

    python bench/precompute.py [--samples 24] [--max-length 512] [--batch-tokens 4096]

1. tokens/s of `spec precompute` (target forward with hooks, chunked full-vocab stats, ragged shard
   writes) divided by tokens/s of a bare `model(input_ids, attention_mask)` forward over the same
   batches, measured in the same run (goal: >= 0.9);
2. bytes per token on disk for each encoding at Vd = 8192 and 32000, beside the SpecForge layout
   ((3H + H) values per token) and the `probs` layout (Vd values per token).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from spec_cli import assets
from spec_cli.artifacts import feature_cache as fc
from spec_cli.data.batching import collate, plan_batches
from spec_cli.data.tokenize import tokenize_data
from spec_cli.stages import build_vocab_map, precompute
from spec_cli.targets import loading


def bare_forward_seconds(model, tokens, batches) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for indices in batches:
            ids, am, _ = collate(tokens, indices)
            model(input_ids=ids, attention_mask=am)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    target = assets.ensure_smollm2()
    data = assets.ensure_sharegpt()
    work = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    vocab = {}
    for vd in (8192, 32000):
        vocab[vd] = work / f"vm{vd}.safetensors"
        build_vocab_map.run(
            build_vocab_map.BuildVocabMapConfig(
                target=str(target),
                data=str(data),
                output=vocab[vd],
                draft_vocab_size=vd,
                max_length=args.max_length,
                num_proc=os.cpu_count() or 1,
            )
        )

    tokenizer = loading.load_tokenizer(target)
    tokens = tokenize_data(
        data, tokenizer, loading.tokenizer_fingerprint(tokenizer), args.max_length
    )
    lengths = tokens.lengths[: args.samples]
    batches = plan_batches(lengths, args.batch_tokens)
    n_tokens = int(lengths.sum())
    model = loading.load_model(target, torch.device("cpu"), torch.float32)

    # --- throughput: alternate bare forward and precompute, keep each one's best
    bare, spec = [], []
    for r in range(args.repeats):
        bare.append(bare_forward_seconds(model, tokens, batches))
        result = precompute.run(
            precompute.PrecomputeConfig(
                target=str(target),
                data=str(data),
                vocab_map=vocab[8192],
                output=work / f"tp{r}",
                batch_tokens=args.batch_tokens,
                shard_tokens=1 << 30,
                max_length=args.max_length,
                max_samples=args.samples,
                resume=False,
            )
        )
        assert result.computed_tokens == n_tokens
        spec.append(result.compute_seconds)
    bare_tps, spec_tps = n_tokens / min(bare), n_tokens / min(spec)
    print(
        f"\nsamples {args.samples}, tokens {n_tokens}, batches {len(batches)}, "
        f"batch tokens {args.batch_tokens}, torch threads {torch.get_num_threads()}"
    )
    print(f"bare model(input_ids) forward : {bare_tps:8.1f} tokens/s  (best of {args.repeats})")
    print(f"spec precompute (hidden)      : {spec_tps:8.1f} tokens/s  (best of {args.repeats})")
    print(f"ratio precompute / bare       : {spec_tps / bare_tps:.3f}   (goal >= 0.9)")

    # --- bytes per token on disk
    H = model.config.hidden_size
    print(f"\nbytes per token on disk (SmolLM2: H = {H}; fp32 model on CPU)")
    print(f"{'layout':44s} {'Vd':>6s} {'values/token':>13s} {'bytes/token':>12s}")
    few = min(args.samples, 4)
    for vd in (8192, 32000):
        for encoding in ("hidden", "probs"):
            out = work / f"size-{encoding}-{vd}"
            result = precompute.run(
                precompute.PrecomputeConfig(
                    target=str(target),
                    data=str(data),
                    vocab_map=vocab[vd],
                    output=out,
                    encoding=encoding,
                    batch_tokens=args.batch_tokens,
                    max_length=args.max_length,
                    max_samples=few,
                    resume=False,
                )
            )
            m = result.manifest
            measured = m["bytes"] / m["num_tokens"]
            values = 4 * H if encoding == "hidden" else 3 * H + vd
            print(
                f"{'spec_cli ' + encoding + ' (measured, shards only)':44s} {vd:6d} {values:13d} "
                f"{measured:12.0f}"
            )
        print(f"{'SpecForge layout (3H + H), bf16':44s} {vd:6d} {4 * H:13d} {4 * H * 2:12d}")
        print(f"{'SpecForge layout (3H + H), fp32':44s} {vd:6d} {4 * H:13d} {4 * H * 4:12d}")
        print(
            f"{'probs layout (3H aux + Vd probs), bf16':44s} {vd:6d} {3 * H + vd:13d} "
            f"{(3 * H + vd) * 2:12d}"
        )
    head = (work / "size-hidden-8192" / fc.HEAD).stat().st_size
    print(
        f"(once per cache: head.safetensors {head / 1e6:.1f} MB = lm_head rows for Vd + input embeddings)"
    )


if __name__ == "__main__":
    main()
