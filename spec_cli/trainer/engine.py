"""`spec train --eval-engine vllm|torch`: the run's checkpoints decoded by a real engine while it
trains.

Teacher-forced metrics can keep rising after the acceptance a served draft reaches has peaked
(docs/recipe.md), so every --eval-engine-every steps, and at the last one, the trainer writes the
current weights (RUN/engine-eval/step-N/checkpoint, weights only: `hand_over`) and hands the step to
a worker process it started once (`start`; the process: engine_process.py). The worker exports them
through `spec export`'s own path, self-check included, and decodes the run's fixed prompts, greedy,
a chain of the run's depth, the target alone beside it on the same prompts (eval's decode loop).

Results come back on a pipe and are logged when they arrive (log.jsonl `split: "engine"`, the console,
training.png); the loop never waits for them, except at its last step, whose checkpoint is evaluated
before the run ends. With `--keep best` the checkpoint whose acceptance length was the best (ties: the
later step) is kept as RUN/best, which `spec export RUN` and `spec eval RUN` take by default; its
best.json carries what the engine measured, so a `--resume` keeps the record.

The prompts: --eval-prompts FILE, or the batches the run holds out from training (--eval-fraction):
--eval-engine-prompts of their conversations, first two user turns, written once to
RUN/engine-eval/prompts.jsonl (`spec eval --prompts` of that file gives the same numbers).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli import distributed, threads
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts.io import atomic_path, remove_temporaries
from spec_cli.console import info, warn
from spec_cli.draft import algorithms, sharding
from spec_cli.errors import ConfigError, DataError, SpecError
from spec_cli.trainer.engine_process import WORKER_LOG, EngineEvaluator, WorkerConfig, step_dir

PROMPTS = "prompts.jsonl"


# ----------------------------------------------------------------------------- before training


def check_options(cfg) -> None:
    """--eval-engine / --keep / --eval-prompts, refused before anything loads or is written."""
    rt = cfg.runtime
    if rt.keep == "best" and not rt.eval_engine:
        raise ConfigError(
            "--keep best keeps the checkpoint the engine measured best, and no --eval-engine is "
            "given",
            "add --eval-engine vllm (or torch), or drop --keep best",
        )
    if not rt.eval_engine:
        return
    check_available(rt.eval_engine, algorithms.get(cfg.draft.algorithm))
    if rt.eval_prompts:
        from spec_cli.eval import prompts

        found = prompts.load_conversations(rt.eval_prompts)  # one line when it holds no user turn
        if any(conv.images for conv in found):
            raise ConfigError(
                f"--eval-prompts {rt.eval_prompts} has image prompts; the engine decodes text",
                "pass text chats",
            )


def check_available(engine: str, algorithm) -> None:
    """Refuse before anything is written: an engine that is not installed, an algorithm it cannot serve."""
    if engine == "vllm":
        from spec_cli.engine import vllm

        if not vllm.available():
            raise ConfigError(
                "--eval-engine vllm needs vLLM, which is not installed",
                f"{vllm.INSTALL_HINT}; or --eval-engine torch",
            )
    if (
        engine == "vllm"
        and (fmt := algorithm.engine_format("vllm")) is not None
        and vllm.cannot_run(fmt)
    ):
        raise ConfigError(
            f"--eval-engine vllm cannot run {algorithm.title} drafts here: {vllm.cannot_run(fmt)}",
            "--eval-engine torch",
        )
    if not any(f.engine == "vllm" for f in algorithm.formats):
        why = algorithm.not_served or "it has no export vLLM reads"
        raise ConfigError(
            f"--eval-engine decodes the run's export; {algorithm.title} drafts have none ({why})",
            "evaluate its checkpoints with `spec eval` (PyTorch) after training",
        )


@dataclass
class EnginePlan:
    """What the engine in the loop runs with, decided (and checked) before the run folder is touched."""

    worker: WorkerConfig
    prompts: (
        list[dict] | None
    )  # the held-out conversations to write to RUN/engine-eval/prompts.jsonl
    device: torch.device  # the trainer's (rank 0's): on a GPU the worker shares it


def plan(cfg, source, schedule, trainer, natural_depth: Callable) -> EnginePlan:
    """The worker's config (the target it runs, its device and threads, the depth) and its prompts.
    `natural_depth(draft_config)`: the chain `spec eval` decodes the draft with, the depth when
    --eval-engine-depth is not given."""
    rt = cfg.runtime
    target = eval_target(cfg, source)
    written = None
    prompts_path = rt.eval_prompts
    if not prompts_path:
        prompts_path = str(Path(rt.output) / ckpt.ENGINE_EVAL / PROMPTS)
        if not (
            rt.resume and Path(prompts_path).is_file()
        ):  # chosen once: the same ones on --resume
            written = held_out_records(cfg, source, schedule)
    device = trainer.device
    template = cfg.data.chat_template
    if cfg.data.cache is not None:
        template = template_arg(source.chat_template.get("chat_template_source"))
    worker = WorkerConfig(
        run_dir=str(rt.output),
        engine=rt.eval_engine,
        target=str(target),
        prompts=prompts_path,
        depth=rt.eval_engine_depth or natural_depth(trainer.draft_config),
        max_new_tokens=rt.eval_engine_tokens,
        num_prompts=rt.eval_engine_prompts if rt.eval_prompts else None,
        export_format=trainer.algorithm.engine_format("vllm").name,
        device="cuda:0" if device.type == "cuda" else device.type,
        dtype=None,
        memory=rt.eval_engine_memory if device.type == "cuda" else None,
        threads=max(1, threads.available_cores() // 2),
        chat_template=template,
    )
    return EnginePlan(worker, written, device)


def template_arg(source: str | None) -> str | None:
    """The --chat-template a recorded `chat_template_source` stands for (None: the target's own)."""
    if not source or source in ("the target's tokenizer", "none"):
        return None
    return source.removeprefix("family ").strip()


def eval_target(cfg, source) -> str:
    """The target the engine runs: --eval-engine-target, the run's --target, or its cache's."""
    rt = cfg.runtime
    if rt.eval_engine_target:
        return rt.eval_engine_target
    if cfg.data.target:
        return cfg.data.target
    if cfg.data.cache is not None:
        manifest = json.loads((Path(cfg.data.cache) / "manifest.json").read_text())
        if manifest.get("target") and Path(manifest["target"]).exists():
            return manifest["target"]
        raise ConfigError(
            f"--eval-engine runs the target, and the one the cache was made from "
            f"({manifest.get('target')}) is not here",
            "pass --eval-engine-target FOLDER",
        )
    raise ConfigError(
        "--eval-engine runs the target on this machine; --remote serves it elsewhere",
        "pass --eval-engine-target with a local copy of the target",
    )


def held_out_records(cfg, source, schedule) -> list[dict]:
    """--eval-engine-prompts conversations of the held-out batches (none of whose records the run trains
    on), a seeded choice in file order, as {"id", "source_index", "turns": first two user turns[,
    "system"]}."""
    import torch

    from spec_cli.data import records
    from spec_cli.eval.prompts import _user_turns

    hint = "pass --eval-prompts FILE (held-out chats or mt-bench), or keep --eval-fraction above 0"
    if not schedule.eval:
        raise ConfigError(
            "--eval-engine decodes held-out conversations, and this run holds none out "
            "(--eval-fraction 0, or too few batches)",
            hint,
        )
    data = data_file(cfg)
    index = source.tokens.source_index
    trained = {int(index[i]) for batch in schedule.train for i in batch}
    held = sorted({int(index[i]) for batch in schedule.eval for i in batch} - trained)
    table = records.load_records(data)
    usable = []
    for i in held:
        record = table[i]
        if records.has_images(record):
            continue
        turns, system = _user_turns(record)
        if turns:
            usable.append(
                {
                    "id": f"heldout-{i}",
                    "source_index": i,
                    "turns": turns[:2],
                    **({"system": system} if system else {}),
                }
            )
    if not usable:
        raise DataError(f"the held-out batches of {data} have no text chat with a user turn", hint)
    count = min(cfg.runtime.eval_engine_prompts, len(usable))
    order = torch.randperm(
        len(usable), generator=torch.Generator().manual_seed(cfg.optim.seed + 104729)
    )
    return [usable[i] for i in sorted(order[:count].tolist())]


def data_file(cfg) -> Path:
    """The chat data the run's samples were tokenised from: --data, or the file its cache records (it
    must be the same file: its fingerprint is checked)."""
    from spec_cli import assets
    from spec_cli.artifacts.io import sha256_path

    if cfg.data.cache is None:
        return Path(assets.resolve_data_arg(cfg.data.data))
    manifest = json.loads((Path(cfg.data.cache) / "manifest.json").read_text())
    path = Path(manifest.get("data") or "")
    hint = "pass --eval-prompts FILE (held-out chats or mt-bench)"
    if not manifest.get("data") or not path.is_file():
        raise ConfigError(
            f"the held-out conversations are read from the data the cache was made from "
            f"({manifest.get('data')}), which is not here",
            hint,
        )
    recorded = str(manifest.get("data_fingerprint", "")).split(":")[0]
    if recorded and sha256_path(path)[: len(recorded)] != recorded:
        raise ConfigError(
            f"{path} changed since the cache was made from it, so its held-out records cannot be "
            "found",
            hint,
        )
    return path


# ------------------------------------------------------------------- at the run's start (rank 0)


def recover_best(run_dir: Path) -> None:
    """A run killed between atomic_dir_from's two renames left RUN/.best.old and no RUN/best: put it back
    (before the run's start clears temporaries)."""
    best, old = Path(run_dir) / ckpt.BEST, Path(run_dir) / f".{ckpt.BEST}.old"
    if not best.exists() and (old / ckpt.BEST_JSON).is_file():
        os.replace(old, best)


def clear_abandoned(run_dir: Path) -> None:
    """A new run (not --resume) in a folder without checkpoints (spec train refuses one with them): what
    an abandoned run there left of the engine in the loop is not this run's, and RUN/best would be
    exported in its place."""
    run_dir = Path(run_dir)
    found = [p for p in (run_dir / ckpt.BEST, run_dir / ckpt.ENGINE_EVAL) if p.exists()]
    if found:
        info(
            f"removing {', '.join(str(p) for p in found)}: left by an earlier run in this folder that saved no "
            "checkpoint"
        )
        for path in found:
            shutil.rmtree(path, ignore_errors=True)


def start(cfg, plan: EnginePlan, logger) -> EngineEvaluator:
    """Rank 0: the held-out prompts written (once), the snapshots an interrupted run left removed,
    and the engine's worker process started; its answers go to the log (`logger`, a TrainLogger) as
    they come."""
    rt = cfg.runtime
    if plan.prompts is not None:
        write_prompts(Path(rt.output), plan.prompts)
    remove_unanswered(rt.output)
    env = dict(os.environ)
    if plan.worker.device.startswith(
        "cuda"
    ):  # the trainer's GPU, shared under --eval-engine-memory
        env["CUDA_VISIBLE_DEVICES"] = visible_device(plan.device)
    depth = plan.worker.depth

    def on_result(record: dict) -> None:
        logger.log(record, result_text(record, depth))

    w = plan.worker
    signature = {
        "engine": w.engine,
        "prompts": prompts_digest(w.prompts, w.num_prompts),
        "depth": w.depth,
        "max_new_tokens": w.max_new_tokens,
    }
    evaluator = EngineEvaluator(plan.worker, rt.keep == "best", on_result, env, signature, warn)
    evaluator.start()
    where = f"{plan.worker.prompts}" + (
        f" ({rt.eval_engine_prompts} of them)" if rt.eval_prompts else ""
    )
    info(
        f"engine in the loop: {rt.eval_engine} decodes {where}, chain {depth}, {rt.eval_engine_tokens} tokens a "
        f"turn, every {rt.eval_engine_every} steps, in its own process (log: "
        f"{Path(rt.output) / ckpt.ENGINE_EVAL / WORKER_LOG})"
        + ("; the best checkpoint is kept as RUN/best" if rt.keep == "best" else "")
    )
    return evaluator


def write_prompts(run_dir: Path, chosen: list[dict]) -> Path:
    """RUN/engine-eval/prompts.jsonl: the held-out conversations, one JSON record a line (a file
    `spec eval --prompts` reads)."""
    path = Path(run_dir) / ckpt.ENGINE_EVAL / PROMPTS
    with atomic_path(path) as tmp:
        tmp.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen), encoding="utf-8"
        )
    return path


def remove_unanswered(run_dir: Path) -> None:
    """At a run's start: what an earlier, interrupted run left in RUN/engine-eval: snapshots it handed
    over and never heard back about, exports the worker did not finish, half-written files."""
    folder = Path(run_dir) / ckpt.ENGINE_EVAL
    if not folder.is_dir():
        return
    remove_temporaries(folder)
    for step in folder.glob("step-*"):
        for name in ("checkpoint", "export"):
            shutil.rmtree(step / name, ignore_errors=True)
        remove_temporaries(step)


def visible_device(device) -> str:
    """CUDA_VISIBLE_DEVICES for the worker: the trainer's GPU, as the trainer's own variable numbers it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device.index or 0
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return ids[index] if index < len(ids) else str(index)
    return str(index)


def prompts_digest(prompts: str, num_prompts: int | None) -> str:
    """What identifies the engine's prompts: the file's content (sha256, 16 hex) and how many are taken."""
    from spec_cli import assets
    from spec_cli.artifacts.io import sha256_path

    try:
        digest = sha256_path(Path(assets.resolve_data_arg(prompts)))[:16]
    except (OSError, SpecError):
        digest = str(prompts)
    return f"{digest}:{num_prompts}"


# ----------------------------------------------------------------------------- in the loop


def hand_over(trainer, step: int, engine: EngineEvaluator | None, last: bool) -> None:
    """The weights after `step` steps to the engine in the loop: every rank takes part in gathering them
    (FSDP2), rank 0 writes them (RUN/engine-eval/step-N/checkpoint, weights only) and hands the step to
    the worker, unless its backlog is full (then this step is skipped, and said; never the last)."""
    if (
        engine is not None and last and not engine.ready()
    ):  # the last step is always evaluated: wait for room
        engine.finish()
    ready = engine is not None and engine.ready()
    if trainer.sharded:  # gathering the weights is collective: every rank takes part, or none
        ready = distributed.any_rank(ready)
    if not ready:
        if engine is not None and engine.dead is None:
            info(
                f"engine @ {step}: skipped, the engine is still on step(s) "
                f"{', '.join(map(str, sorted(engine.pending)))} (raise --eval-engine-every)"
            )
        return
    model_state, _ = sharding.full_state(
        trainer.draft,
        trainer.optimizer,
        trainer.names,
        sharded=trainer.sharded,
        with_optimizer=False,
    )
    if engine is None:  # ranks > 0
        return
    folder = step_dir(trainer.cfg.runtime.output, step) / "checkpoint"
    s = trainer.schedule
    ckpt.save_weights(
        folder,
        step,
        model_state,
        trainer.draft_config.to_dict(),
        {"step": step, "epoch": s.epoch(step), "total_steps": s.total_steps},
        frozen=trainer.frozen_record,
    )
    engine.submit(step, folder)


def result_text(record: dict, depth: int) -> str:
    """One console line for an answer."""
    step = record["step"]
    if "error" in record:
        return f"engine @ {step}: not evaluated: {record['error']}"
    rates = " ".join("-" if r is None else f"{r:.2f}" for r in record.get("acceptance_rate") or [])
    best = "  (best so far: kept as RUN/best)" if record.get("best") else ""
    busy = f"  [{record['warning']}]" if record.get("warning") else ""
    return (
        f"engine @ {step} ({record['engine']}, chain {depth}, {record['turns']} turns, {record['seconds']:.0f} s): "
        f"accept len {record['acceptance_length']:.3f}  per position {rates}  speed-up "
        f"{record['speedup']:.2f}x{best}{busy}"
    )
