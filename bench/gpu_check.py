"""The one command to run when a machine with a GPU is at hand (no network needed).

    python bench/gpu_check.py [--shape 8b|tiny] [--lengths 8192,32768] [--steps 20] [--out DIR]

Builds a random-weight target of the shape (default on CUDA: Llama-3.1-8B's, in bf16, from its config:
no download; elsewhere a tiny one, so that the script is known to start: tests/test_gpu_check.py),
then through the CLI, in this process:
  1. `spec build-vocab-map` on random chats long enough for every length;
  2. `spec precompute` at the first length (8 rows);
  3. `spec train --cache` for --steps steps at the first length, reading the cache ahead (the default)
     and with --prefetch 0 (each batch read when asked): the read-ahead must not be slower;
  4. `spec train --target --pack` (live) for --steps steps at the first length, ~8 documents per row
     (packed rows: the varlen attention on CUDA);
  5. `spec train --target` (live) for --steps steps at each other length;
  6. bench/packed_attention.py at the first length: per-document calls against one varlen call.
For each stage: wall time, tokens/s and the peak memory (CUDA: the allocator's peak for the stage;
elsewhere the process's peak RSS so far) beside `spec plan`'s prediction for that step; then which
attention kernels the draft checked and chose.
The tokenizer is a small BPE (tests/tiny.py): ids past its 400 are never drawn, which changes nothing
the timings depend on. Results go to OUT/gpu_check.json too. Exits 1 if any stage failed (the others
still run: a failure at 32k should not hide the 8k numbers).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # transformers LlamaConfig fields
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
}


def make_target(folder: Path, shape: str, device: torch.device) -> Path:
    """Tokenizer (tests/tiny.py's llama3 family) + config + random weights (bf16 on CUDA), saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests import tiny

    tokenizer = tiny.build_tokenizer("llama3")
    fields = dict(SHAPES[shape])
    config = LlamaConfig(
        **fields,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return folder


def make_data(path: Path, length: int, rows: int) -> Path:
    """`rows` chats whose answers run past `length` tokens (--max-length cuts them there)."""
    from tests import tiny

    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(rows):
            answer = " ".join(rng.choice(tiny.WORDS[:-1]) for _ in range(length))
            f.write(
                json.dumps(
                    {
                        "conversations": [
                            {"from": "human", "value": tiny.random_text(rng)},
                            {"from": "gpt", "value": answer},
                        ]
                    }
                )
                + "\n"
            )
    return path


class Stage:
    """Time one CLI command in this process; its peak memory; its success."""

    def __init__(self, name: str, device: torch.device, results: list):
        self.name, self.device, self.results = name, device, results

    def run(self, argv: list[str], tokens: int | None = None, log: Path | None = None) -> bool:
        from spec_cli.cli import main

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            code = main([str(a) for a in argv])
            error = None if code == 0 else f"exit {code}"
        except BaseException as exc:  # noqa: BLE001 - report it and go on to the next stage
            code, error = 1, f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        seconds = time.perf_counter() - start
        row = {
            "stage": self.name,
            "ok": error is None,
            "seconds": round(seconds, 2),
            "error": error,
            "peak_memory_gb": round(self.peak_gb(), 2),
            "peak_memory_kind": "CUDA allocator, this stage"
            if self.device.type == "cuda"
            else "process RSS so far",
        }
        if tokens and error is None:
            row["tokens_per_s"] = round(tokens / seconds, 1)
        if log is not None and error is None:  # the trainer's own measure, steps only
            records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            rates = [
                r["tokens_per_s"]
                for r in records
                if r.get("split") == "train" and "tokens_per_s" in r
            ]
            if rates:
                row["train_tokens_per_s"] = round(rates[-1], 1)
            peaks = [r["peak_memory_gb"] for r in records if "peak_memory_gb" in r]
            if peaks:
                row["train_peak_memory_gb"] = peaks[-1]  # the trainer's own figure (its log)
        self.results.append(row)
        print(json.dumps(row), flush=True)
        return error is None

    def peak_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def packed_attention(row: int, device: torch.device) -> dict:
    """bench/packed_attention.py at this row length: per-document calls against one varlen call."""
    from bench import packed_attention as bench

    start = time.perf_counter()
    try:
        variants = bench.main(["--row", str(row), "--no-dense", "--repeats", "3"])
        row_ = {"stage": f"packed TTT attention T={row}", "ok": True, "variants": variants}
    except Exception as exc:  # noqa: BLE001 - report it and go on
        traceback.print_exc()
        row_ = {
            "stage": f"packed TTT attention T={row}",
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
        }
    row_["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(row_), flush=True)
    return row_


def kernels() -> dict:
    """The draft attention kernels self-checked in this process, and whether each passed."""
    from spec_cli.draft import attention

    return {
        f"{name} on {dev}{'' if index is None else f':{index}'} {str(dtype).replace('torch.', '')}": ok
        for (name, dev, index, dtype), ok in attention._checked.items()
    }


def predict(target: Path, lengths: list[int], device: torch.device, results: list) -> dict:
    """`spec plan`'s step peaks for these lengths (bf16 on CUDA, fp32 elsewhere), beside each train
    stage's measured peak (on CUDA the allocator's peak, the same kind of number; elsewhere RSS, which
    is not)."""
    from spec_cli.plan.report import PlanSettings, make_plan

    try:
        plan = make_plan(
            PlanSettings(
                target=target,
                seq_lens=tuple(lengths),
                gpus=1,
                avg_tokens=lengths[0],
                samples=8,
                gpu_memory=1e3,
                gpu_tflops=1.0,
                precision="bf16" if device.type == "cuda" else "fp32",
            )
        )
    except Exception as exc:  # noqa: BLE001 - the plan failing is a finding, not a reason to stop
        traceback.print_exc()
        results.append({"stage": "plan", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return {}
    steps = {r.seq_len: r for r in plan.steps if not r.activation_checkpointing}
    for row in results:
        kind, _, at = row["stage"].partition(" T=")
        if kind.startswith("train") and at and int(at) in steps:
            step = steps[int(at)]
            row["plan_peak_gb"] = round(
                (step.peak_live_gb if "--target" in kind else step.peak_gb) * 1e9 / 2**30, 2
            )
    print(
        json.dumps({"plan": {T: round(r.peak_gb * 1e9 / 2**30, 2) for T, r in steps.items()}}),
        flush=True,
    )
    return {
        "unit": "GiB",
        "step_peak": {T: round(r.peak_gb * 1e9 / 2**30, 2) for T, r in steps.items()},
        "step_peak_with_live_target": {
            T: round(r.peak_live_gb * 1e9 / 2**30, 2) for T, r in steps.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="default: 8b on CUDA, tiny elsewhere")
    ap.add_argument(
        "--lengths",
        default=None,
        help="row lengths in tokens (default: 8192,32768 for 8b, 256,512 for tiny)",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--out", type=Path, help="work folder, kept (default: a temporary one, removed)"
    )
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape or ("8b" if device.type == "cuda" else "tiny")
    lengths = [
        int(x) for x in (args.lengths or ("8192,32768" if shape == "8b" else "256,512")).split(",")
    ]
    vd = (
        32000 if shape == "8b" else 600
    )  # both more than the tokenizer's 400 ids: the 8b case's paths
    work = args.out or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    import os

    os.environ.setdefault("SPEC_HOME", str(work / "home"))
    about = {
        "device": str(device),
        "torch": torch.__version__,
        "shape": shape,
        "lengths": lengths,
        "steps": args.steps,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    print(json.dumps(about), flush=True)
    results: list[dict] = []

    start = time.perf_counter()
    target = make_target(work / "target", shape, device)
    results.append(
        {"stage": "build target", "ok": True, "seconds": round(time.perf_counter() - start, 2)}
    )
    print(json.dumps(results[-1]), flush=True)
    data = make_data(work / "chats.jsonl", max(lengths), max(args.steps, 8) + 2)
    vm = work / "vm.safetensors"
    ok = Stage("build-vocab-map", device, results).run(
        [
            "build-vocab-map",
            "-t",
            target,
            "-d",
            data,
            "--draft-vocab-size",
            vd,
            "--max-length",
            max(lengths),
            "-o",
            vm,
            "-q",
        ]
    )
    first, rest = lengths[0], lengths[1:]
    if ok:
        cache = work / f"cache-{first}"
        rows = 8
        if Stage(f"precompute T={first}", device, results).run(
            [
                "precompute",
                "-t",
                target,
                "-d",
                data,
                "-v",
                vm,
                "-o",
                cache,
                "--max-length",
                first,
                "--batch-tokens",
                first,
                "--max-samples",
                rows,
                "-q",
            ],
            tokens=rows * first,
        ):
            for prefetch, name in (
                (2, ""),
                (0, " --prefetch 0"),
            ):  # read ahead (default) / when asked
                run = work / f"train-cache-{first}-prefetch-{prefetch}"
                Stage(f"train --cache{name} T={first}", device, results).run(
                    [
                        "train",
                        "--cache",
                        cache,
                        "-v",
                        vm,
                        "-o",
                        run,
                        "--max-steps",
                        args.steps,
                        "--batch-tokens",
                        first,
                        "--eval-fraction",
                        "0",
                        "--log-every",
                        args.steps,
                        "--prefetch",
                        prefetch,
                        "-q",
                    ],
                    tokens=None,
                    log=run / "log.jsonl",
                )
        run = work / f"train-live-packed-{first}"
        Stage(
            f"train --target --pack T={first}", device, results
        ).run(  # ~8 documents per row: varlen
            [
                "train",
                "--target",
                target,
                "--data",
                data,
                "-v",
                vm,
                "-o",
                run,
                "--pack",
                "--max-length",
                max(first // 8, 96),
                "--batch-tokens",
                first,
                "--max-samples",
                8 * args.steps,
                "--max-steps",
                args.steps,
                "--eval-fraction",
                "0",
                "--log-every",
                args.steps,
                "-q",
            ],
            log=run / "log.jsonl",
        )
        for length in rest:
            run = work / f"train-live-{length}"
            Stage(f"train --target T={length}", device, results).run(
                [
                    "train",
                    "--target",
                    target,
                    "--data",
                    data,
                    "-v",
                    vm,
                    "-o",
                    run,
                    "--max-length",
                    length,
                    "--batch-tokens",
                    length,
                    "--max-samples",
                    args.steps,
                    "--max-steps",
                    args.steps,
                    "--eval-fraction",
                    "0",
                    "--log-every",
                    args.steps,
                    "-q",
                ],
                log=run / "log.jsonl",
            )
    results.append(packed_attention(first, device))
    report = {
        **about,
        "stages": results,
        "attention_kernels_checked": kernels(),
        "plan_prediction": predict(target, lengths, device, results),
    }
    (work / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(
        json.dumps({"attention_kernels_checked": report["attention_kernels_checked"]}), flush=True
    )
    failed = [r["stage"] for r in results if not r["ok"]]
    print(
        f"gpu_check: {len(results) - len(failed)} of {len(results)} stages passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + f" ({work / 'gpu_check.json'})"
    )
    if args.out is None:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
