"""Supervision throughput of the vLLM target engine vs the transformers one, on the same batches.

    python bench/runner.py [--batches 2] [--batch-tokens 1024] [--max-length 512] [--repeats 3]
                           [--samples 160] [--draft-vocab-size 8192]

Real SmolLM2-135M target (CPU, fp32; `spec assets` installs it), real ShareGPT conversations batched
as `spec train` batches them, a draft vocab built on the same conversations. Each batch goes through
HFTargetBackend.generate_batch and VLLMTargetBackend.generate_batch (the whole TargetBatch: aux states,
full-vocab argmax / logsumexp, target_p over the draft vocab) in the same process; each repeat times
one pass of each back to back (order alternating), and the figure is the median over repeats of

    vLLM supervision tokens/s / transformers supervision tokens/s

Every vLLM batch is compared with the transformers one (max |diff| per float field, integer fields
counted). Both engines get the same intra-op threads: OMP_NUM_THREADS (default: all cores) is set
before torch loads, whatever vLLM's own serving default. The machine's load average is printed with
the figures: on shared cores the absolute tokens/s move with it, the alternating ratio much less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spec_cli import assets  # noqa: E402
from spec_cli.artifacts.vocab_map import load_vocab_map  # noqa: E402
from spec_cli.data.batching import collate, plan_batches  # noqa: E402
from spec_cli.data.tokenize import tokenize_data  # noqa: E402
from spec_cli.stages import build_vocab_map  # noqa: E402
from spec_cli.targets import loading  # noqa: E402
from spec_cli.targets.hf_backend import HFTargetBackend  # noqa: E402


def timed_pass(backend, requests) -> tuple[float, list]:
    start = time.perf_counter()
    out = [backend.generate_batch(*r) for r in requests]
    return time.perf_counter() - start, out


def compare(want: list, got: list) -> dict:
    """Max |diff| per float field over all batches (aux states also relative to their largest
    magnitude: SmolLM2's residual stream reaches hundreds); integer fields: how many entries differ."""
    diffs: dict[str, float] = {}
    for a, b in zip(want, got):
        for name, x in a.tensors().items():
            y = b.tensors()[name]
            if x.is_floating_point():
                diff = float((x.float() - y.float()).abs().max())
                diffs[name] = max(diffs.get(name, 0.0), diff)
                if name == "aux_hidden":
                    diffs["aux_hidden (relative)"] = max(
                        diffs.get("aux_hidden (relative)", 0.0), diff / float(x.abs().max())
                    )
            else:
                diffs[f"{name} (entries differing)"] = diffs.get(
                    f"{name} (entries differing)", 0
                ) + int((x != y).sum())
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--samples",
        type=int,
        default=160,
        help="ShareGPT records read (and counted for the draft vocab)",
    )
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    args = parser.parse_args()
    target = assets.ensure_smollm2()
    data = assets.ensure_sharegpt()
    tokenizer = loading.load_tokenizer(target)
    tok_fp = loading.tokenizer_fingerprint(tokenizer)
    work = Path(tempfile.mkdtemp(prefix="spec-bench-runner-"))

    subset = work / "sharegpt-subset.jsonl"
    with open(data, encoding="utf-8") as src:
        subset.write_text(
            "".join(line for _, line in zip(range(args.samples), src)), encoding="utf-8"
        )
    tokens = tokenize_data(subset, tokenizer, tok_fp, args.max_length, use_cache=False)
    plan = plan_batches(tokens.lengths, args.batch_tokens)[: args.batches]
    requests = [collate(tokens, indices) for indices in plan]
    n_tokens = sum(int(am.sum()) for _, am, _ in requests)
    vocab_path = work / "vocab.safetensors"
    build_vocab_map.run(
        build_vocab_map.BuildVocabMapConfig(
            target=str(target),
            data=str(subset),
            output=vocab_path,
            draft_vocab_size=args.draft_vocab_size,
            max_length=args.max_length,
        )
    )
    selected = load_vocab_map(vocab_path).selected_token_ids

    from spec_cli.targets.vllm_backend import VLLMTargetBackend

    start = time.perf_counter()
    hf = HFTargetBackend(target, None, "cpu", "fp32")
    hf_load = time.perf_counter() - start
    start = time.perf_counter()
    vb = VLLMTargetBackend(target, None, "cpu", "fp32")
    vllm_load = time.perf_counter() - start
    try:
        for backend in (hf, vb):
            backend.set_vocab_mapping(selected)
            backend.generate_batch(*requests[-1])  # warm-up
        paths = {"transformers": hf, "vllm": vb}
        rows: dict[str, list[float]] = {key: [] for key in paths}
        diffs = None
        for r in range(args.repeats):
            outs = {}
            for key in list(paths) if r % 2 == 0 else list(reversed(paths)):
                seconds, outs[key] = timed_pass(paths[key], requests)
                rows[key].append(seconds)
            diffs = diffs or compare(outs["transformers"], outs["vllm"])
            print(
                f"  repeat {r}: " + ", ".join(f"{k} {rows[k][-1]:.2f} s" for k in paths), flush=True
            )
    finally:
        vb.close()
        hf.close()

    ratio = statistics.median(a / b for a, b in zip(rows["transformers"], rows["vllm"]))
    result = {
        key: {
            "tokens_per_s": round(n_tokens / statistics.median(times), 1),
            "seconds": [round(t, 2) for t in times],
        }
        for key, times in rows.items()
    }
    print(
        f"SmolLM2-135M fp32 on {torch.get_num_threads()} torch threads, {len(requests)} batches, "
        f"{n_tokens} tokens (B x T <= {args.batch_tokens}), draft vocab {selected.numel()}; load "
        f"transformers {hf_load:.1f} s, vLLM {vllm_load:.1f} s; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    for key, row in result.items():
        print(
            f"  {key:13s} {row['tokens_per_s']:8.1f} supervision tokens/s   runs {row['seconds']} s"
        )
    print(f"  vLLM / transformers: x{ratio:.3f} (median of per-repeat ratios)")
    print(
        "  vLLM - transformers, max |diff|: "
        + ", ".join(f"{k} {v:.2g}" for k, v in sorted(diffs.items()))
    )
    print(
        json.dumps(
            {
                "ratio_vllm_over_transformers": round(ratio, 3),
                "tokens": n_tokens,
                "batches": len(requests),
                "threads": torch.get_num_threads(),
                **result,
                "max_abs_diff": diffs,
            }
        )
    )


if __name__ == "__main__":
    main()
