"""The demo's draft measured by both evaluators on the same prompts: spec_cli's PyTorch decoder and vLLM
(`spec eval --engine torch` vs `--engine vllm`), side by side, plus vLLM's speed-up over vLLM's target
alone, measured in the same run.

    python bench/engine_eval.py [--draft SPEC_HOME/demo/quick/export-vllm] [--num-prompts 8]
                                [--max-new-tokens 64] [--depth 3]

Needs the `vllm` extra. The draft defaults to the full demo's export, else the quick demo's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def default_draft() -> Path:
    from spec_cli.paths import spec_home

    for profile in ("full", "quick"):
        folder = spec_home() / "demo" / profile / "export-vllm"
        if (folder / "config.json").is_file():
            return folder
    raise SystemExit("no demo export found: run `spec demo --quick` first, or pass --draft")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", type=Path, default=None)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()

    from spec_cli.stages import eval as stage

    draft = args.draft or default_draft()
    out = Path(tempfile.mkdtemp(prefix="bench-engine-eval-"))
    results = {}
    for engine in (
        "torch",
        "vllm",
    ):  # torch first: building a vLLM engine lowers this process's threads
        r = stage.run(
            stage.EvalConfig(
                target=args.target,
                draft=draft,
                prompts=args.prompts,
                output=out / engine,
                depth=args.depth,
                num_prompts=args.num_prompts,
                max_new_tokens=args.max_new_tokens,
                engine=engine,
            )
        )
        results[engine] = r.overall
    t, v = results["torch"], results["vllm"]
    print(
        f"draft {draft}, {t['turns']} turns of {args.prompts}, chain of {args.depth}, greedy, "
        f"{args.max_new_tokens} new tokens"
    )
    print(f"{'':28}{'spec_cli (torch)':>18}{'vLLM':>12}")
    print(f"{'acceptance length':28}{t['acceptance_length']:>18.3f}{v['acceptance_length']:>12.3f}")
    for j, (a, b) in enumerate(zip(t["acceptance_rate"], v["acceptance_rate"])):
        fa = "-" if a is None else f"{a:.3f}"
        fb = "-" if b is None else f"{b:.3f}"
        print(f"{f'acceptance rate, position {j + 1}':28}{fa:>18}{fb:>12}")
    print(f"{'accepted per position':28}{str(t['accepted']):>18}{str(v['accepted']):>12}")
    print(f"{'target forwards':28}{t['target_forwards']:>18}{v['target_forwards']:>12}")
    print(
        f"{'same output as target alone':28}{t['same_as_target']:>15}/{t['turns']:<2}"
        f"{v['same_as_target']:>9}/{v['turns']:<2}"
    )
    print(f"{'spec tokens/s':28}{t['spec_tokens_per_s']:>18.1f}{v['spec_tokens_per_s']:>12.1f}")
    print(
        f"{'target-alone tokens/s':28}{t['target_tokens_per_s']:>18.1f}{v['target_tokens_per_s']:>12.1f}"
    )
    print(f"{'speed-up over own target':28}{t['speedup']:>17.2f}x{v['speedup']:>11.2f}x")
    print(
        f"ratio vLLM / spec_cli acceptance length: {v['acceptance_length'] / t['acceptance_length']:.3f}"
    )
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
