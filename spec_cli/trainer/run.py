"""`train`: one `spec train` run, from its config to its result.

It reads top to bottom: -o checked, --resume's options reconciled (resume.py), the process started
(its device, the process group, the seed), the source of supervision opened and the batches planned
(sources.py), the draft built through its algorithm into a Trainer (trainer.py), the latest
checkpoint restored and run.json written (checkpoints.py), then `train_loop` (loop.py). Whatever
ends the run, what it started stops in reverse: the engine's worker, the batch producers, the log,
the target's backend.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli import distributed, threads
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts import outputs
from spec_cli.artifacts.guard import FolderLock
from spec_cli.artifacts.io import write_json
from spec_cli.artifacts.vocab_map import load_vocab_map
from spec_cli.console import info, warn
from spec_cli.draft import algorithms
from spec_cli.engine.vllm_versions import serving_line
from spec_cli.errors import ConfigError
from spec_cli.stream.bound import size_text
from spec_cli.targets import loading, local
from spec_cli.train_options import TrainConfig
from spec_cli.trainer import checkpoints, engine, resume
from spec_cli.trainer.draft import algorithm_fields, check_algorithm
from spec_cli.trainer.log import TrainLogger, plot_curves
from spec_cli.trainer.loop import train_loop
from spec_cli.trainer.metrics import metric_steps
from spec_cli.trainer.sources import Schedule, open_batches, open_source
from spec_cli.trainer.trainer import Trainer


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path
    steps: int
    seconds: float
    final_train: dict | None
    final_eval: dict | None
    plot: Path | None
    total_steps: int | None = None  # the planned steps (> steps when --max-time stopped the run)
    stream: dict | None = None  # the stream store's health report (--stream)
    engine: dict | None = (
        None  # --eval-engine: {"evaluations": [answers], "best": RUN/best's record or None}
    )


def train(
    cfg: TrainConfig, given: set[str] | None, natural_depth: Callable, after_step=None
) -> TrainResult:
    """Train as `cfg` says; `after_step(step)` is called after each optimizer step (tests use it).

    `given`: the options the user gave (command line or --config); with --resume the others come
    from the run's run.json (None: every option counts as given). `natural_depth(draft_config)`: the
    chain `spec eval` decodes a draft with, which the engine in the loop decodes when
    --eval-engine-depth is not given. The run folder is locked (rank 0) while it is written."""
    start_time = time.perf_counter()
    _check_output(
        cfg
    )  # before anything: the inputs as given (a resumed run's own come from its folder)
    cfg = resume.resumed_config(cfg, given)
    cfg = resume.kept_batch(cfg, given)
    device = _start(cfg)
    with (
        ExitStack() as lock
    ):  # taken (rank 0) once the inputs are checked, before the folder is touched
        return _run(cfg, device, start_time, after_step, lock, given, natural_depth)


def _run(
    cfg: TrainConfig,
    device: torch.device,
    start_time: float,
    after_step,
    lock: ExitStack,
    given: set[str] | None,
    natural_depth: Callable,
) -> TrainResult:
    vocab_map = load_vocab_map(cfg.data.vocab_map)
    engine.check_options(cfg)  # before the target loads
    info(serving_line(algorithms.get(cfg.draft.algorithm)))  # where the trained draft can be served
    if cfg.runtime.eval_engine and device.type == "cuda" and distributed.is_main():
        # the engine's process takes --eval-engine-memory of this GPU: training keeps to the rest
        torch.cuda.set_per_process_memory_fraction(1 - cfg.runtime.eval_engine_memory, device)
    source = open_source(cfg, device, vocab_map)
    _say_unused_batch_tokens(cfg, source, given)
    batches = logger = stream_report = evaluator = None
    try:
        source.backend.set_vocab_mapping(vocab_map.selected_token_ids)
        algorithm = check_algorithm(cfg, source)
        schedule = Schedule.plan(source, cfg)
        source.backend.keep_final_hidden = algorithm.final_hidden  # EAGLE-1/2's feature
        source.backend.extra_fields = algorithm_fields(
            algorithm
        )  # the algorithm's own per-token fields
        trainer = Trainer(
            cfg,
            algorithm,
            source,
            vocab_map,
            schedule,
            device,
            auto_checkpointing=given is not None and "activation_checkpointing" not in given,
        )
        plan = None
        if cfg.runtime.eval_engine:
            plan = engine.plan(cfg, source, schedule, trainer, natural_depth)
        run_json = resume.run_record(cfg, source, vocab_map)
        if distributed.is_main():  # the run folder is one, shared by the ranks
            lock.enter_context(FolderLock(cfg.runtime.output, "spec train"))
            # (a RUN/best being replaced when the run was killed)
            engine.recover_best(cfg.runtime.output)
            ckpt.remove_temporaries(cfg.runtime.output)  # a killed run's half-written files
        resume.check_run_dir(cfg, run_json)
        if (
            distributed.is_main() and not cfg.runtime.resume
        ):  # an abandoned run's RUN/best is not this run's
            engine.clear_abandoned(cfg.runtime.output)
        if (
            distributed.is_main()
            and cfg.runtime.resume
            and (damaged := ckpt.set_aside_damaged(cfg.runtime.output))
        ):
            warn(
                damaged
            )  # newest checkpoints cut short (a copy, a failing disk): set aside, resumed from the one before
        distributed.check_shared_folder(
            cfg.runtime.output, "the run folder"
        )  # torchrun: one folder for all
        latest = ckpt.latest_checkpoint(cfg.runtime.output) if cfg.runtime.resume else None
        step = checkpoints.restore(trainer, latest) if latest is not None else 0
        checkpoints.write_run(trainer, run_json)  # rank 0: run.json and the frozen weights
        trainer.make_model()
        checkpoints.check_room(trainer)
        logger = TrainLogger(
            cfg.runtime.output,
            schedule.total_steps,
            enabled=schedule.rank == 0,
            start_step=step,
            world=schedule.world,
        )
        _say_plan(trainer, schedule, device)
        if plan is not None and distributed.is_main():
            evaluator = engine.start(cfg, plan, logger)
        batches = open_batches(cfg, source, schedule, step * cfg.optim.grad_accum, device)
        step, final_train, final_eval = train_loop(
            trainer, batches, logger, step, after_step, evaluator
        )
    finally:
        if (
            evaluator is not None
        ):  # the worker stops (at once on an error or Ctrl-C); unanswered snapshots go
            try:
                evaluator.close(hurry=sys.exc_info()[0] is not None)
            except Exception as exc:  # noqa: BLE001 (never hide the error that ended the run)
                warn(f"could not stop the engine process cleanly: {exc}")
        if batches is not None:  # stop the producers and free the store before the target goes
            batches.close()
            if cfg.runtime.stream:
                stream_report = batches.report()
                _save_stream_report(cfg, stream_report)
        if logger is not None:
            logger.close()
        received = getattr(getattr(source.backend, "backend", source.backend), "received", None)
        if received:  # --remote: how the answers came (the tensor plane, or HTTP bodies)
            info(
                f"remote supervision: {received['plane']} batch(es) over the tensor plane, "
                f"{received['http']} in HTTP bodies"
            )
        source.backend.close()
    distributed.barrier()
    plot = plot_curves(cfg.runtime.output) if distributed.is_main() else None
    checkpoint_dir = ckpt.latest_checkpoint(cfg.runtime.output)
    distributed.shutdown()
    engine_report = None
    if evaluator is not None:
        engine_report = {
            "evaluations": evaluator.done,
            "best": ckpt.best_record(cfg.runtime.output) if cfg.runtime.keep == "best" else None,
            "seconds": evaluator.seconds,
        }
    return TrainResult(
        Path(cfg.runtime.output),
        checkpoint_dir,
        step,
        time.perf_counter() - start_time,
        final_train,
        final_eval,
        plot,
        schedule.total_steps,
        stream_report,
        engine_report,
    )


# ----------------------------------------------------------------------------- setup


def _say_unused_batch_tokens(cfg: TrainConfig, source, given: set[str] | None) -> None:
    """A feature cache keeps the batches `spec precompute` planned unless --pack plans rows anew: a
    --batch-tokens given beside it that differs from the cache's changes nothing, and the user is told
    (a step then holds the cache's tokens, not theirs)."""
    if (
        cfg.data.cache is None
        or cfg.data.pack
        or (given is not None and "batch_tokens" not in given)
    ):
        return
    made = source.backend.reader.manifest.get("batch_tokens")
    if made is not None and made != cfg.data.batch_tokens:
        warn(
            f"--batch-tokens {cfg.data.batch_tokens} does not apply: the feature cache {cfg.data.cache} "
            f"keeps the batches `spec precompute` planned ({made} tokens each, padding included); "
            f"precompute with --batch-tokens {cfg.data.batch_tokens}, or add --pack to plan rows of "
            f"{cfg.data.batch_tokens} tokens from the cache"
        )


def _check_output(cfg: TrainConfig) -> None:
    """-o is a run folder of its own: not one of the run's inputs (nor inside one, nor holding one), not a
    folder of another kind (a cache, a model, an export, files of yours), before anything is written."""
    d, r = cfg.data, cfg.runtime
    if distributed.is_main():
        outputs.check(
            {"-o": (r.output, outputs.TRAINING_RUN)},
            {
                "--cache": d.cache,
                "--target": d.target,
                "--data": d.data,
                "--vocab-map": d.vocab_map,
                "--chat-template": d.chat_template,
                "--stream-dir": r.stream_dir,
                "--eval-prompts": r.eval_prompts,
                "--eval-engine-target": r.eval_engine_target,
            },
        )


def _start(cfg: TrainConfig) -> torch.device:
    """This process's device (torchrun: its rank's), the process group, the seed; a --target-engine check."""
    device = distributed.local_device(loading.choose_device(cfg.runtime.device))
    distributed.init(device)
    if (
        distributed.world_size() > 1
    ):  # the machine's cores shared by its ranks, not all of them each
        torch.set_num_threads(threads.choose_for_run().threads)
    torch.manual_seed(cfg.optim.seed)
    local.check_engine(cfg.runtime.target_engine)
    if cfg.runtime.target_engine != "transformers" and cfg.data.target is None:
        raise ConfigError(
            f"--target-engine {cfg.runtime.target_engine} runs a live --target in this process",
            "drop --target-engine (a cache or a server decides), or train from --target",
        )
    return device


def _say_plan(trainer: Trainer, schedule: Schedule, device: torch.device) -> None:
    """The run in one line: batches, steps, objective, device, precision, attention, parallelism
    (and MSD's curriculum in another)."""
    cfg, precision = trainer.cfg, "bf16" if trainer.autocast_dtype else "fp32"
    info(
        f"training: {len(schedule.train)} train / {len(schedule.eval)} eval batches, "
        f"{schedule.total_steps} steps of {schedule.per_step} micro-batch(es), "
        f"{trainer.algorithm.steps_name} {metric_steps(cfg, trainer.algorithm)}, "
        f"loss {cfg.objective.loss}, device {device}, {precision}, attention {trainer.attention}"
        + (
            f", {'FSDP2' if trainer.sharded else 'DDP'} over {schedule.world} processes"
            if schedule.world > 1
            else ""
        )
        + (
            f" (context parallel: each row split over {schedule.context} of them, {schedule.data_world} "
            "data-parallel replica(s))"
            if schedule.context > 1
            else ""
        )
    )
    if schedule.curriculum is not None:
        info(
            f"curriculum: {schedule.curriculum.describe()}; {len(schedule.pools[0])} text and "
            f"{len(schedule.pools[1])} image-text train batches"
        )


# ----------------------------------------------------------------------------- teardown


def _save_stream_report(cfg: TrainConfig, report: dict) -> None:
    """stream.json in the run folder (rank 0; also after an error or Ctrl-C) and one log line."""
    info(
        f"stream: {report['produced']} batches produced, {report['consumed']} consumed, peak "
        f"{report['peak_bytes'] / 2**20:.1f} MiB in the store, bound {size_text(report['max_bytes'])} "
        f"({report['max_bytes_source']}); the trainer waited "
        f"{report['trainer_wait_s']:.1f} s, producers {report['put_wait_s']:.1f} s on the bound"
    )
    if distributed.is_main():
        try:
            write_json(Path(cfg.runtime.output) / "stream.json", report)
        except OSError as exc:  # never hide the error that ended the run
            info(f"could not write stream.json: {exc}")
