"""The target's cost per training token: answer then precompute (two passes) against answering once with
`spec regenerate --features` (one pass), on the demo's target and prompts (vLLM needed).

    python bench/one_pass.py [--samples 320] [--out DIR]

Runs, on the same ShareGPT prompts with the demo's lengths and dtype (bf16 where native):
1. `spec regenerate --engine vllm`, then `spec precompute` of its output in transformers (what the demo
   does) and in vLLM: the two-pass cost;
2. `spec regenerate --engine vllm --features`: the one-pass cost;
and prints target seconds per 1,000 cache tokens for each, the ratio two-pass / one-pass, how many
answers the two regenerations share, and the largest difference between the one-pass cache and a vLLM
precompute of the same text (states relative to their scale).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from spec_cli import assets
from spec_cli.artifacts import feature_cache as fc
from spec_cli.stages import build_vocab_map, demo, precompute, regenerate


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def shard_diffs(a: Path, b: Path) -> dict:
    """{field: max |a - b| / max |b|} over the float fields of two caches with the same layout."""
    out = {}
    for i in range(fc.read_manifest(b)["num_shards"]):
        x, y = load_file(str(a / fc.shard_name(i))), load_file(str(b / fc.shard_name(i)))
        for name in x:
            if x[name].is_floating_point():
                scale = float(y[name].float().abs().max()) or 1.0
                out[name] = max(
                    out.get(name, 0.0),
                    float((x[name].float() - y[name].float()).abs().max()) / scale,
                )
            elif (
                name == "argmax"
            ):  # the target's greedy token: the share of positions where it differs
                out.setdefault("_argmax", [0, 0])
                out["_argmax"][0] += int((x[name] != y[name]).sum())
                out["_argmax"][1] += x[name].numel()
            elif not torch.equal(x[name], y[name]):
                out[name] = "differs"
    if "_argmax" in out:
        differ, total = out.pop("_argmax")
        out["argmax differs"] = differ / total
    return out


def show(diffs: dict) -> str:
    return ", ".join(
        f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(diffs.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    found = assets.ensure_all()
    profile = demo.PROFILES["full"]
    dtype = demo.data_dtype(demo.DemoConfig())
    out = args.out or Path(tempfile.mkdtemp(prefix="one-pass-"))
    out.mkdir(parents=True, exist_ok=True)
    target, data = str(found["smollm2"]), str(found["sharegpt"])
    common = dict(
        target=target,
        data=data,
        temperature=0.0,
        max_new_tokens=profile.regen_max_new_tokens,
        max_length=profile.max_length,
        max_samples=args.samples,
        dtype=dtype,
        engine="vllm",
    )

    # one-time costs of the first engine in a process (imports, kernels) are not either way's
    regenerate.run(
        regenerate.RegenerateConfig(output=out / "warmup.jsonl", **{**common, "max_samples": 2})
    )
    two, t_regen = timed(
        lambda: regenerate.run(regenerate.RegenerateConfig(output=out / "two.jsonl", **common))
    )
    vocab = out / "vocab.safetensors"
    build_vocab_map.run(
        build_vocab_map.BuildVocabMapConfig(
            target=target,
            data=str(two.output),
            output=vocab,
            draft_vocab_size=profile.draft_vocab_size,
            max_length=profile.max_length,
            force=True,
        )
    )
    pre = dict(
        target=target,
        data=str(two.output),
        vocab_map=vocab,
        max_length=profile.max_length,
        dtype=dtype,
        resume=False,
    )
    hf, t_hf = timed(
        lambda: precompute.run(precompute.PrecomputeConfig(output=out / "two-hf", **pre))
    )
    _, t_vllm = timed(
        lambda: precompute.run(
            precompute.PrecomputeConfig(output=out / "two-vllm", target_engine="vllm", **pre)
        )
    )
    one, t_one = timed(
        lambda: regenerate.run(
            regenerate.RegenerateConfig(
                output=out / "one.jsonl", features=out / "one-cache", vocab_map=vocab, **common
            )
        )
    )
    check, _ = timed(
        lambda: precompute.run(
            precompute.PrecomputeConfig(
                target=target,
                data=str(one.output),
                vocab_map=vocab,
                output=out / "one-check",
                max_length=profile.max_length,
                dtype=dtype,
                target_engine="vllm",
                resume=False,
            )
        )
    )

    tokens_two = hf.manifest["num_tokens"]
    tokens_one = fc.read_manifest(out / "one-cache")["num_tokens"]
    same = sum(
        a == b
        for a, b in zip(
            (out / "two.jsonl").read_text().splitlines(),
            (out / "one.jsonl").read_text().splitlines(),
        )
    )
    rows = {
        "two passes (precompute in transformers)": (t_regen + t_hf, tokens_two),
        "two passes (precompute in vLLM)": (t_regen + t_vllm, tokens_two),
        "one pass (regenerate --features)": (t_one, tokens_one),
    }
    print(
        f"\n{args.samples} prompts, {dtype or 'fp32'}, {os.cpu_count()} cores; regenerate {t_regen:.1f} s, "
        f"precompute {t_hf:.1f} s (transformers) / {t_vllm:.1f} s (vLLM); regenerate --features {t_one:.1f} s"
    )
    for name, (seconds, tokens) in rows.items():
        print(
            f"  {name:42s} {seconds:7.1f} s for {tokens} tokens: {1000 * seconds / tokens:.3f} s per 1k tokens"
        )
    per = {k: s / t for k, (s, t) in rows.items()}
    best_two = min(
        per["two passes (precompute in transformers)"], per["two passes (precompute in vLLM)"]
    )
    print(
        f"  two passes / one pass: {best_two / per['one pass (regenerate --features)']:.2f}x (the faster "
        f"two-pass way)"
    )
    share = one.meta["features"]["from_generation"]
    print(
        f"  one pass: {share:.0%} of the rows' positions computed while answering; "
        f"{same} of {args.samples} conversations identical to the two-pass regeneration"
    )
    print("  max |diff| / max |value| per field:")
    print(
        f"    one-pass cache vs vLLM precompute of its text:        {show(shard_diffs(out / 'one-cache', out / 'one-check'))}"
    )
    print(
        f"    (the yardstick) transformers vs vLLM precompute, same text: {show(shard_diffs(out / 'two-hf', out / 'two-vllm'))}"
    )


if __name__ == "__main__":
    main()
