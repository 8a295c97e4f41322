"""`spec train`: train a draft of any registered --algorithm (EAGLE-3 by default, EAGLE-1/2, P-EAGLE).

Supervision comes from a feature cache (`--cache`), a live target (`--target`) or served targets
(`--remote`), all through the TargetBackend interface (train_sources.py). The batch plan is fixed up
front and the data position is a function of the step alone, so `--resume` continues exactly where a
run stopped. Batches are made when the loop asks for them, or ahead of it by producer threads through
a bounded store (spec_cli/stream) with `--stream`, and for `--remote` with `--prefetch N`; the
batches, and so the weights, are the same bit for bit.

`run` reads top to bottom: set up, build the draft (through the algorithm: spec_cli/draft/algorithm.py),
resume, then `train_loop`; the pieces it calls follow it.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import shutil
import signal
import sys
import time
import typing
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spec_cli import distributed, threads
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts import guard, outputs
from spec_cli.artifacts.guard import FolderLock
from spec_cli.artifacts.io import write_json
from spec_cli.artifacts.vocab_map import load_vocab_map
from spec_cli.console import human_bytes, info, warn
from spec_cli.draft import algorithms, attention, sharding
from spec_cli.draft.algorithm import FINAL_HIDDEN, LM_HEAD, Algorithm
from spec_cli.draft.optim import ordered, scheduled_lr, set_lr
from spec_cli.draft.step import forward_backward, make_optimizer, optimizer_groups, optimizer_step
from spec_cli.draft.losses import acceptance_length
from spec_cli.engine.vllm_versions import serving_line
from spec_cli.errors import ArtifactError, ConfigError, TrainingError
from spec_cli.plan.auto import needs_checkpointing
from spec_cli.stages import engine_eval
from spec_cli.stages.train_log import TrainLogger, plot_curves
from spec_cli.train_options import OptimOptions, TrainConfig, all_options, resumable_options, typed_options
from spec_cli.stages.train_sources import Schedule, Source, open_batches, open_source, supervise
from spec_cli.stopping import SIGNAL_NAMES, StopRequests, Stopped, signal_name
from spec_cli.stream.bound import size_text
from spec_cli.targets import loading, local


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
    engine: dict | None = None  # --eval-engine: {"evaluations": [answers], "best": RUN/best's record or None}


# ----------------------------------------------------------------------------- the stage

def run(cfg: TrainConfig, after_step=None, given: set[str] | None = None) -> TrainResult:
    """Train as `cfg` says; `after_step(step)` is called after each optimizer step (tests use it).

    `given`: the options the user gave (command line or --config); with --resume the others come from
    the run's run.json. None: from the `spec train` command being run, if any (else every option counts
    as given, as the config says). The run folder is locked (rank 0) while it is written."""
    start_time = time.perf_counter()
    _check_output(cfg)  # before anything: the inputs as given (a resumed run's own come from its folder)
    cfg = resumed_config(cfg, typed_options() if given is None else given)
    cfg = kept_batch(cfg, typed_options() if given is None else given)
    device = _start(cfg)
    with ExitStack() as lock:  # taken (rank 0) once the inputs are checked, before the folder is touched
        return _run(cfg, device, start_time, after_step, lock, typed_options() if given is None else given)


def _run(cfg: TrainConfig, device: torch.device, start_time: float, after_step, lock: ExitStack,
         given: set[str] | None) -> TrainResult:
    vocab_map = load_vocab_map(cfg.data.vocab_map)
    _check_engine_options(cfg)  # before the target loads
    info(serving_line(algorithms.get(cfg.draft.algorithm)))  # where the trained draft can be served
    if cfg.runtime.eval_engine and device.type == "cuda" and distributed.is_main():
        # the engine's process takes --eval-engine-memory of this GPU: training keeps to the rest
        torch.cuda.set_per_process_memory_fraction(1 - cfg.runtime.eval_engine_memory, device)
    source = open_source(cfg, device, vocab_map)
    batches = logger = stream_report = evaluator = None
    try:
        source.backend.set_vocab_mapping(vocab_map.selected_token_ids)
        algorithm = _algorithm(cfg, source)
        schedule = Schedule.plan(source, cfg)
        source.backend.keep_final_hidden = algorithm.final_hidden  # EAGLE-1/2's feature
        source.backend.extra_fields = algorithm_fields(algorithm)  # the algorithm's own per-token fields
        trainer = Trainer(cfg, algorithm, source, vocab_map, schedule, device,
                          auto_checkpointing=given is not None and "activation_checkpointing" not in given)
        engine = _plan_engine(cfg, source, schedule, trainer) if cfg.runtime.eval_engine else None
        run_json = _run_json(cfg, source, vocab_map)
        if distributed.is_main():  # the run folder is one, shared by the ranks
            lock.enter_context(FolderLock(cfg.runtime.output, "spec train"))
            engine_eval.recover_best(cfg.runtime.output)  # (a RUN/best being replaced when the run was killed)
            ckpt.remove_temporaries(cfg.runtime.output)  # a killed run's half-written files
        _check_run_dir(cfg, run_json)
        if distributed.is_main() and not cfg.runtime.resume:  # an abandoned run's RUN/best is not this run's
            engine_eval.clear_abandoned(cfg.runtime.output)
        if distributed.is_main() and cfg.runtime.resume and (damaged := ckpt.set_aside_damaged(cfg.runtime.output)):
            warn(damaged)  # newest checkpoints cut short (a copy, a failing disk): set aside, resumed from the one before
        distributed.check_shared_folder(cfg.runtime.output, "the run folder")  # torchrun: one folder for all
        latest = ckpt.latest_checkpoint(cfg.runtime.output) if cfg.runtime.resume else None
        step = trainer.restore(latest) if latest is not None else 0
        trainer.write_run(run_json)  # rank 0: run.json and the frozen weights
        trainer.make_model()
        _check_room(trainer)
        logger = TrainLogger(cfg.runtime.output, schedule.total_steps, enabled=schedule.rank == 0,
                             start_step=step, world=schedule.world)
        info(f"training: {len(schedule.train)} train / {len(schedule.eval)} eval batches, "
             f"{schedule.total_steps} steps of {schedule.per_step} micro-batch(es), "
             f"{trainer.algorithm.steps_name} {metric_steps(cfg, trainer.algorithm)}, loss {cfg.objective.loss}, device {device}, "
             f"{'bf16' if trainer.autocast_dtype else 'fp32'}, attention {trainer.attention}"
             + (f", {'FSDP2' if trainer.sharded else 'DDP'} over {schedule.world} processes"
                if schedule.world > 1 else "")
             + (f" (context parallel: each row split over {schedule.context} of them, {schedule.data_world} "
                "data-parallel replica(s))" if schedule.context > 1 else ""))
        if schedule.curriculum is not None:
            info(f"curriculum: {schedule.curriculum.describe()}; {len(schedule.pools[0])} text and "
                 f"{len(schedule.pools[1])} image-text train batches")
        if engine is not None and distributed.is_main():
            evaluator = _start_engine(cfg, engine, logger)
        batches = open_batches(cfg, source, schedule, step * cfg.optim.grad_accum, device)
        step, final_train, final_eval = train_loop(trainer, batches, logger, step, after_step, evaluator)
    finally:
        if evaluator is not None:  # the worker stops (at once on an error or Ctrl-C); unanswered snapshots go
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
            info(f"remote supervision: {received['plane']} batch(es) over the tensor plane, "
                 f"{received['http']} in HTTP bodies")
        source.backend.close()
    distributed.barrier()
    plot = plot_curves(cfg.runtime.output) if distributed.is_main() else None
    checkpoint_dir = ckpt.latest_checkpoint(cfg.runtime.output)
    distributed.shutdown()
    engine_report = None
    if evaluator is not None:
        engine_report = {"evaluations": evaluator.done, "best": ckpt.best_record(cfg.runtime.output)
                         if cfg.runtime.keep == "best" else None, "seconds": evaluator.seconds}
    return TrainResult(Path(cfg.runtime.output), checkpoint_dir, step, time.perf_counter() - start_time,
                       final_train, final_eval, plot, schedule.total_steps, stream_report, engine_report)


def train_loop(trainer: Trainer, batches, logger: TrainLogger, step: int,
               after_step=None, engine=None) -> tuple[int, dict | None, dict | None]:
    """Optimizer steps from `step` to the end of the schedule, or until --max-time; (the step reached,
    the last train and eval records). A stop signal (Ctrl-C, SIGTERM) finishes the step in flight, logs
    and saves the finished steps (all ranks at the same step) and raises Stopped (spec_cli/stopping.py).
    `engine` (rank 0, --eval-engine): the EngineEvaluator the weights are handed to every
    --eval-engine-every steps; its answers are logged as they come, and the last step's is waited for."""
    rt = trainer.cfg.runtime
    with StopRequests(rt.stop_grace) as stops:
        return _loop(trainer, batches, logger, step, after_step, engine, stops)


def _loop(trainer: Trainer, batches, logger: TrainLogger, step: int, after_step, engine,
          stops: StopRequests) -> tuple[int, dict | None, dict | None]:
    cfg, schedule = trainer.cfg, trainer.schedule
    o, rt, total = cfg.optim, cfg.runtime, schedule.total_steps
    engine_every = rt.eval_engine_every if rt.eval_engine else 0
    window, window_start, last_saved = Metrics(metric_steps(cfg, trainer.algorithm), trainer.device, schedule.context), time.perf_counter(), step
    loop_start, out_of_time, saved_at = time.perf_counter(), False, time.monotonic()
    final_train = final_eval = None
    try:
        while step < total and not out_of_time:
            trainer.set_lr(lr_at(step, total, o))
            losses, tokens = [], []  # on the device: the host waits once per step, not per micro-batch
            for micro in range(o.grad_accum):
                batch = batches.get(step * o.grad_accum + micro)
                out = trainer.forward_backward(batch, sync=micro == o.grad_accum - 1)
                losses.append(out.loss.detach().double().reshape(1))
                tokens.append(batch.attention_mask.sum().double().reshape(1))
                window.add(out, tokens[-1])
            losses = torch.cat(losses)
            if schedule.context > 1:  # a group's ranks hold shares of one batch: a NaN in any stops them all
                torch.distributed.all_reduce(losses, group=trainer.objective.context.group)
            due = rt.save_every_minutes is not None and time.monotonic() - saved_at >= rt.save_every_minutes * 60
            asked = _asked(stops.requested, due, trainer.device)  # [stop, save], agreed by the ranks
            *losses, step_tokens, stop, due = torch.cat([losses, torch.cat(tokens).sum().reshape(1), asked]).tolist()
            step_tokens = int(step_tokens)  # the host's one wait of the step: losses, tokens and requests
            bad = next((i for i, value in enumerate(losses) if not math.isfinite(value)), None)
            if bad is not None:  # before the optimizer step: the weights stay the last good ones
                raise _bad_loss(trainer, step + 1, step * o.grad_accum + bad, losses[bad])
            with stops.shielded():  # the update and its count go together (an abandon saves `step`)
                window.add_grad_norm(trainer.optimizer_step())
                step += 1
            logger.step(step_tokens)
            if stop:  # a rank was signalled: every rank stops after this same step
                stops.answered()
                # its record first: a resume continues after the saved step and never logs it
                logger.log(_train_record(trainer, window, window_start, step, engine))
                _stop(trainer, step, last_saved, stops)
            if after_step is not None:
                after_step(step)

            if o.max_time is not None and step < total:
                out_of_time = distributed.any_rank(time.perf_counter() - loop_start >= o.max_time)
                if out_of_time:
                    info(f"--max-time {o.max_time:g}s reached after step {step} of {total}; "
                         f"saving (rerun with --resume to continue the schedule)")
            last = step == total or out_of_time  # the last step always logs, evaluates and saves
            evaluating = (rt.eval_every and step % rt.eval_every == 0) or last
            # a stop that came during the step: it is logged and saved now, not after an evaluation
            stopping = evaluating and distributed.any_rank(stops.requested)
            if step % rt.log_every == 0 or last or stopping:
                final_train = _train_record(trainer, window, window_start, step, engine)
                logger.log(final_train)
                window, window_start = Metrics(metric_steps(cfg, trainer.algorithm), trainer.device, schedule.context), time.perf_counter()
            if stopping:
                stops.answered()
                _stop(trainer, step, last_saved, stops)
            if evaluating:
                final_eval = trainer.evaluate()
                if final_eval is not None:
                    logger.log({"split": "eval", "step": step, **final_eval})
            if step % rt.save_every == 0 or last or due:
                begun = time.monotonic()
                trainer.save(step)
                last_saved, saved_at, stops.save_seconds = step, time.monotonic(), time.monotonic() - begun
            evaluated = engine_every and (step % engine_every == 0 or last)
            if evaluated:
                trainer.hand_to_engine(step, engine, last)
            if engine is not None:
                engine.poll()  # answers that came back meanwhile: logged, RUN/best kept (never waits)
            if evaluated and (last or rt.eval_engine_wait):
                # the last checkpoint's evaluation (and any before it) comes back before the run ends; the
                # other ranks wait for rank 0 on their own barrier, not in a collective's timeout
                if engine is not None:
                    engine.finish()
                distributed.wait_for_main(f"the engine's evaluation of step {step}", engine_eval.wait_limit())
    except TrainingError:
        raise  # nothing saved: the state after a non-finite loss is not worth keeping
    except KeyboardInterrupt as exc:  # a second signal, or the grace ran out mid-step: the step is abandoned
        if not stops.stopped:  # (else _stop saved what it could and said so)
            _abandoned(trainer, step, last_saved, stops, exc)
        raise
    return step, final_train, final_eval


def _train_record(trainer: Trainer, window: Metrics, window_start: float, step: int, engine) -> dict:
    """The train record of the steps in `window` (summed over the ranks: every rank calls it), up to `step`."""
    window.all_reduce()
    elapsed = time.perf_counter() - window_start
    record = {"split": "train", "step": step, "lr": trainer.lr, **window.record(),
              "tokens_per_s": float(window.tokens) / max(elapsed, 1e-9),
              "steps_in_record": int(float(window.batches) / trainer.schedule.per_step) or 1,
              "peak_memory_gb": peak_memory_gb(trainer.device)}
    if engine is not None:  # how much of the window the engine was decoding beside training
        record["engine_busy"] = round(engine.busy_share(window_start, time.perf_counter()), 3)
    return record


def _asked(stop: bool, save: bool, device: torch.device) -> torch.Tensor:
    """[a stop signal came, a timed save is due] as 0/1 on `device`, each the largest over the ranks: made
    and reduced without the host waiting (the step's one sync reads it)."""
    asked = torch.zeros(2, dtype=torch.float64, device=device)
    if stop:
        asked[0].fill_(1.0)
    if save:
        asked[1].fill_(1.0)
    return distributed.max_in_place(asked)


def _stop(trainer: Trainer, step: int, last_saved: int, stops: StopRequests) -> None:
    """Every rank after the same `step`: save it if the save fits in the grace period (the ranks agree),
    say how to go on, and raise Stopped."""
    signum = stops.signum if stops.signum is not None else signal.SIGTERM  # (a rank that had no signal)
    name, output = SIGNAL_NAMES.get(signum, f"signal {signum}"), trainer.cfg.runtime.output
    if step > last_saved and not distributed.any_rank(not stops.save_fits()):
        saved = trainer.save(step)
        if saved is not None:
            info(f"stopped by {name} after step {step}: saved {saved}; rerun with --resume to continue")
    elif step > last_saved:
        if distributed.is_main():
            warn(f"stopped by {name} after step {step}: saving takes about {stops.save_seconds or 0:.0f} s and "
                 f"{max(stops.left(), 0):.0f} s of --stop-grace {stops.grace:g} are left, so the last checkpoint "
                 f"({_latest_name(output)}) stands; rerun with --resume to continue from it")
    elif distributed.is_main():
        info(f"stopped by {name} after step {step}, which is saved; rerun with --resume to continue")
    stops.stopped = True
    raise Stopped(signum)


def _abandoned(trainer: Trainer, step: int, last_saved: int, stops: StopRequests, exc: KeyboardInterrupt) -> None:
    """The step in flight was cut off: one process saves the finished steps if that fits (the ranks of
    torchrun are at different points, so they keep the last checkpoint)."""
    name, output = signal_name(exc), trainer.cfg.runtime.output
    if step > last_saved and distributed.world_size() == 1 and stops.save_fits():
        saved = trainer.save(step)
        if saved is not None:
            info(f"interrupted by {name}: saved {saved}; rerun with --resume to continue")
    elif step > last_saved and distributed.is_main():
        why = (f"no time left in --stop-grace {stops.grace:g} to save them" if distributed.world_size() == 1
               else "the ranks were cut off at different points")
        info(f"interrupted by {name} with {step} steps done ({why}): the last checkpoint "
             f"({_latest_name(output)}) stands; rerun with --resume to continue from it")
    elif distributed.is_main():
        info(f"interrupted by {name} with {step} steps done, all saved; rerun with --resume to continue")


def _latest_name(output: Path) -> str:
    latest = ckpt.latest_checkpoint(output)
    return "none yet: a rerun starts at step 0" if latest is None else latest.name


# ----------------------------------------------------------------------------- setup

def _start(cfg: TrainConfig) -> torch.device:
    """This process's device (torchrun: its rank's), the process group, the seed; a --target-engine check."""
    device = distributed.local_device(loading.choose_device(cfg.runtime.device))
    distributed.init(device)
    if distributed.world_size() > 1:  # the machine's cores shared by its ranks, not all of them each
        torch.set_num_threads(threads.choose_for_run().threads)
    torch.manual_seed(cfg.optim.seed)
    local.check_engine(cfg.runtime.target_engine)
    if cfg.runtime.target_engine != "transformers" and cfg.data.target is None:
        raise ConfigError(f"--target-engine {cfg.runtime.target_engine} runs a live --target in this process",
                          "drop --target-engine (a cache or a server decides), or train from --target")
    return device


def _check_engine_options(cfg: TrainConfig) -> None:
    """--eval-engine / --keep / --eval-prompts, refused before anything loads or is written."""
    rt = cfg.runtime
    if rt.keep == "best" and not rt.eval_engine:
        raise ConfigError("--keep best keeps the checkpoint the engine measured best, and no --eval-engine is "
                          "given", "add --eval-engine vllm (or torch), or drop --keep best")
    if not rt.eval_engine:
        return
    engine_eval.check_available(rt.eval_engine, algorithms.get(cfg.draft.algorithm))
    if rt.eval_prompts:
        from spec_cli.eval import prompts

        found = prompts.load_conversations(rt.eval_prompts)  # one line when it holds no user turn
        if any(conv.images for conv in found):
            raise ConfigError(f"--eval-prompts {rt.eval_prompts} has image prompts; the engine decodes text",
                              "pass text chats")


@dataclass
class EnginePlan:
    """What the engine in the loop runs with, decided (and checked) before the run folder is touched."""
    worker: object  # engine_eval.WorkerConfig
    prompts: list[dict] | None  # the held-out conversations to write to RUN/engine-eval/prompts.jsonl
    device: torch.device  # the trainer's (rank 0's): on a GPU the worker shares it


def _plan_engine(cfg: TrainConfig, source: Source, schedule: Schedule, trainer: Trainer) -> EnginePlan:
    """The worker's config (the target it runs, its device and threads, the depth) and its prompts."""
    from spec_cli.stages.eval import natural_depth

    rt = cfg.runtime
    target = engine_eval.eval_target(cfg, source)
    written = None
    prompts_path = rt.eval_prompts
    if not prompts_path:
        prompts_path = str(Path(rt.output) / ckpt.ENGINE_EVAL / engine_eval.PROMPTS)
        if not (rt.resume and Path(prompts_path).is_file()):  # chosen once: the same ones on --resume
            written = engine_eval.held_out_records(cfg, source, schedule)
    device = trainer.device
    template = cfg.data.chat_template
    if cfg.data.cache is not None:
        template = engine_eval.template_arg(source.chat_template.get("chat_template_source"))
    worker = engine_eval.WorkerConfig(
        run_dir=str(rt.output), engine=rt.eval_engine, target=str(target), prompts=prompts_path,
        depth=rt.eval_engine_depth or natural_depth(trainer.draft_config), max_new_tokens=rt.eval_engine_tokens,
        num_prompts=rt.eval_engine_prompts if rt.eval_prompts else None,
        export_format=trainer.algorithm.engine_format("vllm").name,
        device="cuda:0" if device.type == "cuda" else device.type, dtype=None,
        memory=rt.eval_engine_memory if device.type == "cuda" else None,
        threads=max(1, threads.available_cores() // 2), chat_template=template)
    return EnginePlan(worker, written, device)


def _start_engine(cfg: TrainConfig, plan: EnginePlan, logger: TrainLogger):
    """Rank 0: the held-out prompts written (once), the snapshots an interrupted run left removed, and the
    engine's worker process started; its answers go to the log as they come."""
    rt = cfg.runtime
    if plan.prompts is not None:
        engine_eval.write_prompts(Path(rt.output), plan.prompts)
    engine_eval.remove_unanswered(rt.output)
    env = dict(os.environ)
    if plan.worker.device.startswith("cuda"):  # the trainer's GPU, shared under --eval-engine-memory
        env["CUDA_VISIBLE_DEVICES"] = engine_eval.visible_device(plan.device)
    depth = plan.worker.depth

    def on_result(record: dict) -> None:
        logger.log(record, engine_eval.result_text(record, depth))

    w = plan.worker
    signature = {"engine": w.engine, "prompts": engine_eval.prompts_digest(w.prompts, w.num_prompts),
                 "depth": w.depth, "max_new_tokens": w.max_new_tokens}
    evaluator = engine_eval.EngineEvaluator(plan.worker, rt.keep == "best", on_result, env, signature, warn)
    evaluator.start()
    where = (f"{plan.worker.prompts}" + (f" ({rt.eval_engine_prompts} of them)" if rt.eval_prompts else ""))
    info(f"engine in the loop: {rt.eval_engine} decodes {where}, chain {depth}, {rt.eval_engine_tokens} tokens a "
         f"turn, every {rt.eval_engine_every} steps, in its own process (log: "
         f"{Path(rt.output) / ckpt.ENGINE_EVAL / engine_eval.WORKER_LOG})"
         + ("; the best checkpoint is kept as RUN/best" if rt.keep == "best" else ""))
    return evaluator


def _algorithm(cfg: TrainConfig, source: Source) -> Algorithm:
    """--algorithm, checked against the aux layers the supervision holds (and --context-parallel)."""
    algorithm = algorithms.get(cfg.draft.algorithm)
    n = cfg.runtime.context_parallel
    if n > 1:
        if not algorithm.context_parallel:
            able = [a.name for a in algorithms.ALGORITHMS.values() if a.context_parallel]
            raise ConfigError(f"--context-parallel: {algorithm.title} does not split its rows over ranks yet (its "
                              "objective attends across whole blocks of a row)",
                              f"drop --context-parallel, or train --algorithm {', '.join(able)}")
    if len(source.aux_layers) != algorithm.aux_layers:
        made = "the feature cache holds" if cfg.data.cache is not None else "the target serves"
        raise ConfigError(f"{made} {len(source.aux_layers)} aux layers {source.aux_layers}; {algorithm.name} "
                          f"reads {algorithm.aux_layers}",
                          f"make the supervision with --algorithm {algorithm.name} (`spec precompute` / "
                          "`spec serve-target`), or train the algorithm it was made for")
    return algorithm


def algorithm_fields(algorithm: Algorithm) -> dict:
    """name -> TargetField: what the algorithm asks the backend for in TargetBatch.extras (its needs
    beyond the built-in final hidden state and lm_head)."""
    own = algorithm.target_fields
    missing = sorted(n for n in algorithm.field_needs() if n != FINAL_HIDDEN and n not in own)
    if missing:
        raise ConfigError(f"{algorithm.name} needs {', '.join(missing)} of the target but its implementation "
                          "defines no such target_fields", "declare them in its implementation module")
    return {name: own[name] for name in algorithm.field_needs() if name != FINAL_HIDDEN}


def build_draft(cfg: TrainConfig, algorithm: Algorithm, source: Source, vocab_map):
    """(draft, its config, the frozen weights it copied from the target): shaped from the target's
    config (the --draft-* options override), embeddings from the target, lm_head too with
    --init-from-target."""
    d = cfg.draft
    if d.draft_window is not None:
        if not algorithm.sliding_window:
            raise ConfigError(f"--draft-window: {algorithm.title} drafts have no sliding-window attention in "
                              "spec_cli (training, decoding and the engines' exports are built for EAGLE-3 only)",
                              "drop --draft-window, or train --algorithm eagle3")
        if d.draft_window <= cfg.objective.ttt_steps:
            raise ConfigError(f"--draft-window {d.draft_window} does not reach over the {cfg.objective.ttt_steps} "
                              "TTT steps: the last step's query would see none of the context",
                              f"use --draft-window {cfg.objective.ttt_steps + 1} or more (speculators: 2048)")
    draft_config = algorithm.config(
        loading.config_from_dict(source.target_config), vocab_map.draft_vocab_size, source.aux_layers,
        num_hidden_layers=d.draft_layers, hidden_size=d.draft_hidden_size,
        intermediate_size=d.draft_intermediate_size, num_attention_heads=d.draft_heads,
        num_key_value_heads=d.draft_kv_heads, fc_norm=d.fc_norm, norm_output=d.norm_output,
        rope_theta=d.draft_rope_theta, sliding_window=d.draft_window,
        target_fingerprint=source.identity["target_fingerprint"],
        tokenizer_fingerprint=source.identity["tokenizer_fingerprint"],
        chat_template_sha256=source.chat_template.get("chat_template_sha256"),
        chat_template_source=source.chat_template.get("chat_template_source", ""),
        tokenizer_base_fingerprint=source.chat_template.get("tokenizer_base_fingerprint", ""),
        vocab_map_fingerprint=vocab_map.fingerprint, algorithm=algorithm.name,
        # the algorithm's options that are part of the draft itself (DFlash: --block-size)
        **{name: getattr(cfg.objective, name) for name in algorithm.draft_options})
    info(f"draft rope: {draft_config.rope_source}")
    draft = algorithm.build(draft_config)
    draft.hidden_noise = cfg.objective.hidden_noise  # not in its config: export and eval never see it
    draft.set_vocab_map(vocab_map.selected_token_ids)
    # The frozen weights (copied from the target, never trained) are stored once per run, as the target
    # holds them (the draft's fp32 copy is an exact upcast); checkpoints leave them out.
    frozen = {}
    if algorithm.own_embeddings:  # (MSD reads the target's input embeddings instead)
        frozen["embed_tokens.weight"] = source.backend.get_input_embeddings()
        rows = frozen["embed_tokens.weight"].shape[0]
        if rows != draft_config.vocab_size:
            raise ConfigError(f"the target's input embedding has {rows} rows for its {draft_config.vocab_size}-token "
                              "vocabulary (Mllama keeps its image tokens past the vocabulary), and a draft "
                              "shares that table with it", "spec_cli does not train drafts for such a target yet")
        draft.copy_embeddings(frozen["embed_tokens.weight"])
    if LM_HEAD in algorithm.needs:  # the draft proposes through the target's own lm_head (EAGLE-1/2)
        head = source.backend.get_output_head()
        if head is None:
            raise ConfigError(f"this supervision does not give the target's lm_head, which a {algorithm.title} "
                              "draft proposes through", "train from a feature cache, a live --target or a server")
        draft.copy_head(head["lm_head_selected"])  # the whole vocabulary: the vocab map selects every id
        frozen["lm_head.weight"] = head["lm_head_selected"]
    elif d.init_from_target:  # (a --resume then loads its checkpoint over it)
        head = source.backend.get_output_head()
        if head is None or not draft.init_from_target(head["lm_head_selected"], head.get("final_norm")):
            info("the draft's lm_head starts random: the target's output head is not available here "
                 "or does not fit the draft's hidden size")
    if d.init_layer_from_target:
        _init_layer(draft, draft_config, source, algorithm)
    return draft, draft_config, frozen


def _init_layer(draft, draft_config, source: Source, algorithm: Algorithm) -> None:
    """--init-layer-from-target: the draft's first layer starts as the target's layer after its highest aux
    layer, fc as a pass-through of that aux state (Eagle3Draft.init_layer_from_target)."""
    if not hasattr(draft, "init_layer_from_target"):
        raise ConfigError(f"--init-layer-from-target starts an EAGLE-3 draft's layer; a {algorithm.title} draft "
                          "has no such layer", "leave it out, or pass --algorithm eagle3")
    where = source.target_dir
    if where is None or not Path(where).is_dir():
        raise ConfigError("--init-layer-from-target reads the target's layer from its weights, and "
                          + ("the feature cache names a target folder this machine does not have "
                             f"({where})" if where else "a served target's weights are not on this machine"),
                          "train from a feature cache made on this machine, or with --target MODEL")
    aux = list(draft_config.aux_layer_ids)
    highest = max(range(len(aux)), key=lambda i: aux[i])
    index = min(aux[highest] + 1, draft_config.target_num_layers - 1)
    draft.init_layer_from_target(loading.read_decoder_layer(Path(where), index), highest)
    info(f"the draft's layer starts as the target's layer {index} (after aux layer {aux[highest]}), fc as a "
         "pass-through of that layer's state")


class Trainer:
    """This rank's draft, optimizer and objective (DDP or FSDP2 under torchrun): a step, an evaluation,
    a checkpoint and its restore."""

    def __init__(self, cfg: TrainConfig, algorithm: Algorithm, source: Source, vocab_map, schedule: Schedule,
                 device: torch.device, auto_checkpointing: bool = False):
        """auto_checkpointing: on a GPU, turn activation checkpointing on when the step would not fit the
        GPU's free memory without it (spec plan's measure; `needs_checkpointing`)."""
        self.cfg, self.algorithm, self.source, self.schedule = cfg, algorithm, source, schedule
        self.device = device
        self.draft, self.draft_config, self.frozen = build_draft(cfg, algorithm, source, vocab_map)
        self.frozen_record = {"keys": sorted(self.frozen), "fingerprint": ckpt.frozen_fingerprint(self.frozen)}
        self.draft.to(device)
        self.autocast_dtype = step_precision(cfg.runtime.precision, device)
        self.precision = "bf16" if self.autocast_dtype is not None else "fp32"  # as run here: recorded
        self.attention = self._attention(cfg.runtime.attention, device)
        self.checkpointing = cfg.runtime.activation_checkpointing
        if not self.checkpointing and auto_checkpointing and device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            if cfg.runtime.eval_engine:  # the engine in the loop takes its share of this GPU (rank 0's)
                free = min(free, int((1 - cfg.runtime.eval_engine_memory) * total))
            on_device = sum(t.numel() * t.element_size() for t in [*self.draft.parameters(), *self.draft.buffers()])
            self.checkpointing = distributed.any_rank(
                needs_checkpointing(algorithm, self.draft_config, cfg, largest_batch(source, cfg), free, on_device,
                                    self.autocast_dtype))
        # the algorithm's objective over the draft (the module evaluation runs)
        self.objective = algorithm.objective(self.draft, cfg.objective, activation_checkpointing=self.checkpointing)
        if schedule.context > 1:  # --context-parallel: the objective splits each batch's rows over its group
            from spec_cli.draft.context import Context, kept_ranges, padded_length

            context = self.objective.context = Context(schedule.context, *distributed.context_group(schedule.context))
            self.draft.noise_offset = context.rank  # --hidden-noise: each rank its own draws for its slots
            if getattr(source.backend, "reads_slots", False):  # a cache, or a live target run once per group:
                halo = self.objective.context_halo  # this rank reads, or is sent, only its slots of a row
                if hasattr(source.backend, "halo"):  # a target run once per group: it sends every rank's slots
                    source.backend.halo = halo
                source.slots_for = lambda T: (padded_length(T, context.size),
                                              kept_ranges(context.size, context.rank, padded_length(T, context.size), halo))
        self.sharded = cfg.runtime.fsdp and schedule.world > 1  # FSDP2; else DDP replicates the draft
        if self.sharded:
            sharding.shard(self.objective, device)  # before the optimizer: it holds the sharded weights
        elif cfg.runtime.fsdp:
            info("--fsdp shards across torchrun processes; with one process it trains as usual")
        # in the optimizer's group order (its state_dict numbers parameters so; checkpoints name them)
        trained = ordered([(n, p) for n, p in self.draft.named_parameters() if p.requires_grad], cfg.optim)
        self.names, self.params = [n for n, _ in trained], [p for _, p in trained]
        self.optimizer = make_optimizer(self.params, cfg.optim, self.names)

    def _attention(self, impl: str, device: torch.device) -> str:
        """--attention: the TTT attention kernel for the step's activations (bf16 under CUDA's autocast,
        else the weights' fp32), self-checked before the first step; says loudly when the fused kernel
        is not used where one exists (a silent fallback halved an H200 run's tokens/s)."""
        dtype = self.autocast_dtype or torch.float32  # the activations' dtype, as _autocast runs the step
        kernel, why = attention.choose(device, dtype, impl)
        self.draft.attn_impl = impl
        if why is not None and attention.fused_kernel(device, dtype) is not None:
            warn(f"{why}: training uses the math attention kernel, slower and with memory O(T^2) in the row "
                 "length; --attention fused stops instead")
        if self.cfg.data.pack:  # documents of a packed batch: one varlen call (CUDA), or one call each
            return f"{kernel.name}, packed rows: {attention.packed_kernel_name(kernel, device, dtype)}"
        return kernel.name

    def restore(self, checkpoint: Path) -> int:
        """Load a checkpoint of this run (weights, optimizer, RNG); the step it was saved at."""
        # a sharded checkpoint of as many ranks as this run: each rank reads its own rows alone
        own_rows = self.sharded and ckpt.optimizer_shards(checkpoint) == self.schedule.world
        parts = ckpt.load_checkpoint(checkpoint, resume=True,
                                     optimizer_rank=self.schedule.rank if own_rows else None)
        saved = (ckpt.checkpoint_meta(checkpoint).get("frozen") or {}).get("fingerprint")
        if saved is not None and saved != self.frozen_record["fingerprint"]:
            raise ArtifactError(f"--resume with a different input embedding than the run trained with "
                                f"({checkpoint} was saved with embedding {saved}, the target's is now "
                                f"{self.frozen_record['fingerprint']})",
                                "resume with the same target and --dtype, or start a new run folder")
        groups = parts["trainer_state"]["param_groups"]
        if own_rows:  # this rank's rows only: a slice of the model file and its own optimizer file
            missing = sorted(set(self.names) - {k.split(".", 1)[1].rsplit(".", 1)[0] for k in parts["optimizer"]})
            if missing:
                raise ArtifactError(f"the optimizer shard of rank {self.schedule.rank} in {checkpoint} lacks "
                                    f"{missing[:3]}", "resume from the checkpoint before it")
            sharding.load_local_state(self.draft, self.optimizer, self.names, self.params,
                                      Path(checkpoint) / "model.safetensors", parts["optimizer"], groups,
                                      self.schedule.rank, self.schedule.world, frozen=parts["frozen_keys"])
        else:
            optimizer_state = ckpt.unflatten_optimizer(parts["optimizer"], groups, self.names)
            sharding.load_full_state(self.draft, self.optimizer, parts["model"], optimizer_state, self.names,
                                     sharded=self.sharded, frozen=parts["frozen_keys"])
        _restore_rng(parts["rng"], self.device)
        step = parts["trainer_state"]["step"]
        if self.schedule.curriculum is not None:  # MSD: the steps so far drew the sources this run would
            recorded, now = parts["trainer_state"].get("curriculum"), self.schedule.curriculum.state(step)
            if recorded != now:
                raise ArtifactError(f"{checkpoint} was trained on another curriculum ({recorded}; this run's "
                                    f"at step {step}: {now})", "resume with the options it was started with")
        info(f"resuming from {checkpoint} (step {step})")
        self._say_precision(parts["trainer_state"].get("precision"), checkpoint)
        return step

    def _say_precision(self, was: str | None, checkpoint: Path) -> None:
        """One line when the checkpoint was trained in another precision than this run's step: --precision
        auto chooses per machine, so a run started where bf16 is native and resumed where it is not goes on
        in fp32. `was` None: a checkpoint that does not record it."""
        if was is None or was == self.precision:
            return
        option = self.cfg.runtime.precision
        if option != "auto":
            why = f"--precision {option}"
        elif os.environ.get("SPEC_TRAIN_PRECISION"):
            why = f"--precision auto follows SPEC_TRAIN_PRECISION={self.precision}"
        else:
            runs = "runs" if self.precision == "bf16" else "does not run"
            why = f"--precision auto: this machine {runs} bf16 natively"
        warn(f"--resume: {Path(checkpoint).name} was trained in {was}, and this run trains in {self.precision} "
             f"({why}); pass --precision {was} to go on in {was}")

    def write_run(self, run_json: dict) -> None:
        """run.json and the frozen weights, once per run folder (rank 0)."""
        output = Path(self.cfg.runtime.output)
        if self.schedule.rank == 0:
            output.mkdir(parents=True, exist_ok=True)
            # beside the options (--precision auto), what this run chose on this machine
            write_json(output / "run.json", {**run_json, "chosen": {"precision": self.precision}})
            ckpt.save_frozen(output, self.frozen, self.frozen_record["fingerprint"],
                             {"target_fingerprint": self.source.identity["target_fingerprint"]})
        self.frozen = None  # the draft holds its copy

    def make_model(self) -> None:
        """The module the loop trains: the objective, or under torchrun without --fsdp its DDP wrapper
        (made once the weights are restored: DDP starts every rank from rank 0's)."""
        self.model = self.objective
        if self.schedule.world > 1 and not self.sharded:
            self.model = nn.parallel.DistributedDataParallel(
                self.objective, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    @property
    def lr(self) -> float:
        return scheduled_lr(self.optimizer)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def forward_backward(self, batch, sync: bool):
        """One micro-batch's loss and gradients; `sync`: the step's last, whose gradients the ranks share."""
        def hold_gradients():
            return sharding.no_gradient_sync(self.objective) if self.sharded else self.model.no_sync()
        autocast = _autocast(self.device, self.autocast_dtype)
        return forward_backward(self.objective, self.model, batch, self.cfg.optim.grad_accum, autocast,
                                hold_gradients if self.schedule.world > 1 else None, sync,
                                gradient_scale=self.schedule.context)

    def optimizer_step(self) -> torch.Tensor:
        """The step; the gradients' global norm before clipping (on the device)."""
        return optimizer_step(self.params, self.optimizer, self.cfg.optim.grad_clip)

    def evaluate(self) -> dict | None:
        return evaluate(self.objective, self.source, self.schedule.eval, self.cfg, self.device, self.autocast_dtype,
                        metric_steps(self.cfg, self.algorithm))

    def hand_to_engine(self, step: int, engine, last: bool) -> None:
        """The weights after `step` steps to the engine in the loop: every rank takes part in gathering them
        (FSDP2), rank 0 writes them (RUN/engine-eval/step-N/checkpoint, weights only) and hands the step to
        the worker, unless its backlog is full (then this step is skipped, and said; never the last)."""
        from spec_cli.stages import engine_eval

        if engine is not None and last and not engine.ready():  # the last step is always evaluated: wait for room
            engine.finish()
        ready = engine is not None and engine.ready()
        if self.sharded:  # gathering the weights is collective: every rank takes part, or none
            ready = distributed.any_rank(ready)
        if not ready:
            if engine is not None and engine.dead is None:
                info(f"engine @ {step}: skipped, the engine is still on step(s) "
                     f"{', '.join(map(str, sorted(engine.pending)))} (raise --eval-engine-every)")
            return
        model_state, _ = sharding.full_state(self.draft, self.optimizer, self.names, sharded=self.sharded,
                                             with_optimizer=False)
        if engine is None:  # ranks > 0
            return
        folder = engine_eval.step_dir(self.cfg.runtime.output, step) / "checkpoint"
        s = self.schedule
        ckpt.save_weights(folder, step, model_state, self.draft_config.to_dict(),
                          {"step": step, "epoch": s.epoch(step), "total_steps": s.total_steps},
                          frozen=self.frozen_record)
        engine.submit(step, folder)

    def save(self, step: int) -> Path | None:
        """A checkpoint after `step` steps (every rank takes part; rank 0 writes it): its folder.

        Under FSDP2 the model is gathered to rank 0 (model.safetensors, what export and eval read) but
        the optimizer state, twice the model's size, is not: each rank writes its own rows of it into
        the folder rank 0 then renames into place (the ranks share the run folder:
        distributed.check_shared_folder)."""
        output, s, o = self.cfg.runtime.output, self.schedule, self.cfg.optim
        model_state, optimizer_state = sharding.full_state(self.draft, self.optimizer, self.names,
                                                           sharded=self.sharded, with_optimizer=not self.sharded)
        staged = shards = None
        if self.sharded:
            if s.rank == 0:
                ckpt.begin_sharded_save(output, step)
            distributed.barrier()
            tensors, layout = sharding.local_optimizer_state(self.optimizer, self.names, self.params, s.rank, s.world)
            ckpt.write_optimizer_shard(ckpt.staging_dir(output, step), s.rank, s.world, tensors, layout)
            distributed.barrier()  # every shard written before rank 0 finishes the folder
            staged, shards = ckpt.staging_dir(output, step), s.world
        if s.rank != 0:
            return None
        if self.sharded:
            opt_tensors, groups = None, [{**g, "params": [self.names[i] for i in g["params"]]}
                                         for g in optimizer_groups(self.optimizer)]
        else:
            opt_tensors, groups = ckpt.flatten_optimizer(optimizer_state, self.names)
        return ckpt.save_checkpoint(
            output, step, model_state, opt_tensors, _rng_state(self.device), self.draft_config.to_dict(),
            {"step": step, "epoch": s.epoch(step), "micro_batches_done": step * s.per_step,
             "total_steps": s.total_steps, "lr": lr_at(max(step - 1, 0), s.total_steps, o),
             "param_groups": groups, "world_size": s.world, "grad_accum": o.grad_accum, "precision": self.precision,
             "parallel": "fsdp" if self.sharded else ("ddp" if s.world > 1 else "single"),
             **({"curriculum": s.curriculum.state(step)} if s.curriculum is not None else {})},
            keep_last=self.cfg.runtime.keep_last, frozen=self.frozen_record, staged=staged, shards=shards)


# ----------------------------------------------------------------------------- the step


def largest_batch(source: Source, cfg: TrainConfig) -> tuple[int, int]:
    """(rows, row length) of the run's largest micro-batch by padded tokens."""
    lengths = getattr(source.tokens, "lengths", None)
    if lengths is None or not source.plan:
        return 1, cfg.data.batch_tokens
    if cfg.data.pack:  # a packed batch is one row
        shapes = [(1, int(lengths[b].sum())) for b in source.plan]
    else:
        shapes = [(len(b), int(lengths[b].max())) for b in source.plan]
    return max(shapes, key=lambda shape: shape[0] * shape[1])


# ----------------------------------------------------------------------------- schedule / metrics

def lr_at(step: int, total: int, optim: OptimOptions) -> float:
    """Linear warmup, then to min_lr_ratio * lr: a cosine over the rest (--schedule cosine), or held
    flat until the last decay_ratio of the steps and decayed linearly over them (wsd)."""
    warmup = max(1, math.ceil(optim.warmup_ratio * total)) if optim.warmup_ratio > 0 else 0
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    floor = optim.min_lr_ratio
    if getattr(optim, "schedule", "cosine") == "wsd":
        decay = max(1, math.ceil(optim.decay_ratio * total))
        start = max(warmup, total - decay)  # the decay's first step
        if step < start:
            return optim.lr
        progress = (step - start + 1) / max(1, total - start)  # the last step reaches the floor
        return optim.lr * (floor + (1 - floor) * (1 - min(1.0, progress)))
    progress = (step - warmup) / max(1, total - warmup)
    return optim.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def metric_steps(cfg: TrainConfig, algorithm: Algorithm) -> int:
    """How many steps the objective reports metrics for: the TTT depth, or what the algorithm says
    (Algorithm.steps(options): DFlash's block offsets)."""
    steps = algorithm.steps
    return int(steps(cfg.objective)) if steps else cfg.objective.ttt_steps


class Metrics:
    """Sums over micro-batches (and ranks) of the TTT metrics, kept on the compute device: adding a
    micro-batch's never waits for the device; the host reads them at a log step (`record`)."""

    def __init__(self, k: int, device: torch.device | None = None, context: int = 1):
        """context: ranks that share each batch (--context-parallel): each adds its share of the batch's
        losses and counts, and 1 / context of the batch itself."""
        zeros = lambda n: torch.zeros(n, dtype=torch.float64, device=device)  # noqa: E731
        self.loss, self.step_loss, self.correct, self.total = zeros(1), zeros(k), zeros(k), zeros(k)
        self.tokens, self.batches = zeros(1), zeros(1)
        self.share = 1.0 / context
        self.grad_norm, self.steps = zeros(1), 0  # the same on every rank: not reduced

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """One optimizer step's gradient norm (before clipping)."""
        self.grad_norm += norm.detach().double()
        self.steps += 1

    def add(self, out, tokens: int | torch.Tensor) -> None:
        self.loss += out.loss.detach().double()
        self.step_loss += out.step_loss.detach().double()
        self.correct += out.correct.double()
        self.total += out.total.double()
        self.tokens += tokens * self.share
        self.batches += self.share

    def all_reduce(self) -> None:
        if distributed.world_size() > 1 and torch.distributed.is_initialized():  # not vLLM's own group
            flat = torch.cat([self.loss, self.step_loss, self.correct, self.total, self.tokens, self.batches])
            torch.distributed.all_reduce(flat)
            k = self.correct.numel()
            self.loss, self.step_loss, self.correct, self.total, self.tokens, self.batches = flat.split(
                [1, k, k, k, 1, 1])

    def record(self) -> dict:
        n = max(float(self.batches), 1.0)
        acc = self.correct / self.total.clamp_min(1)  # [K] top-1 accuracy per TTT step
        record = {"loss": float(self.loss) / n, "step_loss": (self.step_loss / n).tolist(), "acc": acc.tolist(),
                  "acceptance_length": float(acceptance_length(acc)), "tokens": int(round(float(self.tokens)))}
        if self.steps:  # the mean gradient norm of the optimizer steps in the record
            record["grad_norm"] = float(self.grad_norm) / self.steps
        return record


def evaluate(objective: nn.Module, source: Source, eval_batches: list, cfg: TrainConfig,
             device: torch.device, autocast_dtype: torch.dtype | None = None, steps: int | None = None) -> dict | None:
    if not eval_batches:
        return None
    context = cfg.runtime.context_parallel
    metrics = Metrics(steps or cfg.objective.ttt_steps, device, context)
    objective.eval()
    # (a context-parallel group's ranks take the same batches)
    rank, world = distributed.rank() // context, distributed.world_size() // context
    # Every rank runs the same number of forwards (sharded weights are gathered collectively); a rank
    # past the end repeats its last batch without counting it.
    rounds = -(-len(eval_batches) // world)
    with torch.no_grad(), _autocast(device, autocast_dtype):
        for r in range(rounds):
            i = r * world + rank
            batch = supervise(source, eval_batches[min(i, len(eval_batches) - 1)], cfg.data.pack, device)
            out = objective(batch)
            if i < len(eval_batches):
                metrics.add(out, batch.num_tokens)
    objective.train()
    metrics.all_reduce()
    return metrics.record()


# ----------------------------------------------------------------------------- helpers

def peak_memory_gb(device: torch.device) -> float:
    """This rank's peak memory so far, in GiB: on a GPU the caching allocator's peak allocation on
    `device` (what a step needs, not what the allocator reserved); on a CPU the process's peak resident
    set (the model, the target and the batches included)."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)  # KiB on Linux


def step_precision(choice: str, device: torch.device) -> torch.dtype | None:
    """--precision: the training step's autocast dtype over the fp32 weights, None for fp32. auto: bf16
    where the device runs it natively (a GPU; a CPU with AMX or AVX512-BF16, where a SmolLM2-shaped step
    at T = 2048 was 1.4x faster with the same losses to 4 decimals: bench/precision.py), fp32 elsewhere
    (emulated bf16 is slower); the environment's SPEC_TRAIN_PRECISION, when set, is what auto picks."""
    picked = choice
    if choice == "auto":
        picked = os.environ.get("SPEC_TRAIN_PRECISION") or ("bf16" if loading.fast_bf16(device) else "fp32")
    if picked not in ("bf16", "fp32"):
        where = "SPEC_TRAIN_PRECISION" if choice == "auto" else "--precision"
        raise ConfigError(f"unknown {where} {picked!r}", "use auto, bf16 or fp32" if choice != "auto" else
                          "set it to bf16 or fp32, or unset it")
    return torch.bfloat16 if picked == "bf16" else None


def _autocast(device: torch.device, dtype: torch.dtype | None):
    """The step's autocast: `dtype` over fp32 weights, or off (fp32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a run draws from, as the saving rank (rank 0) holds them: the CPU's and, on CUDA,
    the one of the GPU it trains on (`torch_cuda`)."""
    state = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Every rank takes the saved states, the CUDA one into the generator of the GPU it trains on.

    The ranks start from one seed and draw alike (the same shapes: P-EAGLE's COD seed, a context-parallel
    group's shared batch), so rank r's cuda:r generator is where rank 0's cuda:0 is; setting each rank's
    own device from rank 0's device is what resumes them all where they were. (Checkpoints before this
    stored every visible GPU's generator from rank 0's process, whose cuda:r it never drew from: rank r
    got a fresh generator.)"""
    torch.set_rng_state(state["torch_cpu"])
    if device.type != "cuda":
        return
    if "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)
        return
    older = {int(k.rsplit("_", 1)[1]): v for k, v in state.items() if k.startswith("torch_cuda_")}
    if 0 in older:  # rank 0 drew from its device's generator, cuda:0 on one machine
        torch.cuda.set_rng_state(older[0], device)


def _run_json(cfg: TrainConfig, source: Source, vocab_map) -> dict:
    """What run.json records: the options, flat (never the token), and what a --resume must match."""
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.options().items() if k != "token"}
    return {"options": options, "identity": {**source.identity, "vocab_map_fingerprint": vocab_map.fingerprint}}


def _bad_loss(trainer: Trainer, step: int, micro_batch: int, loss: float) -> TrainingError:
    """The error for a non-finite loss at optimizer `step`: which supervision it came from, and the way out."""
    cfg = trainer.cfg
    kept = ckpt.latest_checkpoint(cfg.runtime.output)
    keep = f"; the last good checkpoint {kept} is kept" if kept is not None else "; no checkpoint was written"
    if cfg.data.cache is not None:
        shards = _shards_of(trainer.source, trainer.schedule.indices(micro_batch))
        where = (f"from {', '.join(str(Path(cfg.data.cache) / name) for name in shards)}" if shards
                 else f"from the feature cache {cfg.data.cache}")
        return TrainingError(f"step {step}: the loss is {loss} on a batch {where}{keep}",
                             f"check it with `spec inspect {cfg.data.cache} --verify` and rebuild the cache "
                             f"with `spec precompute ... -o {cfg.data.cache} --no-resume`, then rerun "
                             "(--resume continues from the checkpoint)")
    return TrainingError(f"step {step}: the loss is {loss}{keep}",
                         "lower --lr or check the target's outputs (--dtype), then rerun "
                         "(--resume continues from the checkpoint)")


def _shards_of(source: Source, indices: list[int]) -> list[str]:
    """The cache shard files that hold samples `indices` (in the cache's order); [] if not a cache."""
    from spec_cli.artifacts.feature_cache import shard_name

    backend = getattr(source.backend, "backend", source.backend)  # under the read-ahead's lock
    reader = getattr(backend, "reader", None)
    if reader is None:
        return []
    ends, total = [], 0
    for index in reader.shards:
        total += len(index.sample_offsets) - 1
        ends.append(total)
    return [shard_name(s) for s in sorted({bisect.bisect_right(ends, int(i)) for i in indices})]


# Options whose recorded value is a path, compared on --resume by what matters: the run folder may move
# (it is where the run is); a vocab map, cache or target may too (run.json's identity checks their
# content); the others must be the same file (however the path is written).
_LOCATION = frozenset({"output"})
_BY_CONTENT = frozenset({"vocab_map", "cache", "target"})
_PATHS = frozenset({"data", "chat_template"})


def _same_path(a, b) -> bool:
    if a is None or b is None:
        return a == b
    return a == b or os.path.realpath(str(a)) == os.path.realpath(str(b))


# Options checked by what they make together with the number of processes: the micro-batches of a step
# (kept_batch, against the checkpoint resumed from).
_PER_STEP = frozenset({"grad_accum"})


# Options that belong to one invocation, not to the run: a resumed run that inherited --max-time would
# stop again at once.
_PER_INVOCATION = ("resume", "token", "max_time", "reschedule")


def resumed_config(cfg: TrainConfig, given: set[str] | None) -> TrainConfig:
    """With --resume of a run that has run.json: the options the user did not give (`given`) taken from
    it, so `spec train --resume -o RUN` needs nothing retyped; the given ones are checked against it later
    (_check_run_dir). `given` None: every option counts as given (the config as it is). Refuses a config
    without a vocab map (required but on --resume), or a resume whose recorded one has gone."""
    output = Path(cfg.runtime.output)
    path = output / "run.json"
    if cfg.runtime.resume and given is not None and path.is_file():
        cfg = _from_run_json(cfg, given, path)
    if cfg.runtime.resume and not path.is_file():
        kind = guard.folder_kind(output)
        what = (f"{output} does not exist" if not output.exists() else f"{output} is {kind}" if kind
                else f"{output} holds no run (no run.json)")
        if cfg.data.vocab_map is None or kind is not None:
            raise ConfigError(f"--resume: there is no run to continue in {output}: {what}",
                              "pass the folder of the run to continue as -o, or drop --resume and give the "
                              "inputs to start a run")
        if distributed.is_main():  # a requeued job whose first attempt never got going: start it
            warn(f"--resume: {what}; starting the run there at step 0")
    if cfg.data.vocab_map is None:
        raise ConfigError("--vocab-map is required (with --resume, the run's own is used)",
                          "pass the vocab map written by `spec build-vocab-map`")
    return cfg


def kept_batch(cfg: TrainConfig, given: set[str] | None) -> TrainConfig:
    """--resume over another number of processes (torchrun ranks) than the checkpoint was saved by: each
    optimizer step still takes the run's micro-batches (processes x --grad-accum, the effective batch,
    which the data position and the schedule's length follow from), so --grad-accum becomes what keeps
    them, and one line says so. Refused when the processes cannot split them evenly, or when a typed
    --grad-accum (`given`; None: all of them) would change them."""
    state = _resumed_state(Path(cfg.runtime.output)) if cfg.runtime.resume else None
    world, context = distributed.world_size(), cfg.runtime.context_parallel
    if state is None or world % context:  # (Schedule.plan refuses a --context-parallel that does not divide)
        return cfg
    per_step, was_world = state["micro_batches_done"] // state["step"], state.get("world_size", 1)
    replicas, accum = world // context, cfg.optim.grad_accum
    trained = (f"the run's steps take {_many(per_step, 'micro-batch')} ({_many(was_world, 'process')} x "
               f"--grad-accum {state.get('grad_accum', '?')})")
    if per_step % replicas:
        can = [str(n * context) for n in range(1, per_step + 1) if per_step % n == 0]
        listed = " or ".join(filter(None, [", ".join(can[:-1]), can[-1]]))  # 1, 2, 4 or 8
        raise ConfigError(f"--resume over {_many(world, 'process')}: {trained}, which {replicas} data-parallel "
                          "replicas cannot split evenly",
                          f"resume over {listed} process{'es' if can != ['1'] else ''} (torchrun --nproc-per-node)")
    needed = per_step // replicas
    if needed != accum and (given is None or "grad_accum" in given):
        raise ConfigError(f"--resume with --grad-accum {accum} over {_many(world, 'process')}: "
                          f"{_many(accum * replicas, 'micro-batch')} a step, and {trained}",
                          f"drop --grad-accum (--grad-accum {needed} keeps the run's batch here), or start a "
                          "new run folder")
    if needed != accum or world != was_world:
        info(f"--resume over {_many(world, 'process')} of a run trained over {was_world}: --grad-accum {needed} "
             f"keeps its {_many(per_step, 'micro-batch')} a step")
    if needed == accum:
        return cfg
    return TrainConfig.from_options(**{**cfg.options(), "grad_accum": needed})


def _many(n: int, word: str) -> str:
    """1 process, 2 processes; 1 micro-batch, 4 micro-batches."""
    return f"{n} {word}" + ("" if n == 1 else "es")


def _resumed_state(output: Path) -> dict | None:
    """trainer_state.json of the newest checkpoint that has one readable, with steps done; None if none."""
    for folder in reversed(ckpt.checkpoint_dirs(output)):
        try:
            state = json.loads((folder / "trainer_state.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and state.get("step", 0) > 0 and "micro_batches_done" in state:
            return state
    return None


# Where the supervision comes from: exactly one of them. One typed on --resume replaces the run's (a run
# trained from --target may resume from --remote), so none of the others is taken from run.json.
_SOURCES = ("cache", "target", "remote")


def _from_run_json(cfg: TrainConfig, given: set[str], path: Path) -> TrainConfig:
    try:
        recorded = json.loads(path.read_text())["options"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{path} cannot be read ({exc})",
                            "resume needs the run.json spec train wrote; start a new run folder") from None
    source_typed = any(name in given for name in _SOURCES)
    options, declared = cfg.options(), all_options()
    for name, value in recorded.items():
        if name in given or name not in declared or name in _LOCATION or name in _PER_INVOCATION:
            continue
        if source_typed and name in _SOURCES:
            continue
        if value is not None and (declared[name].type is Path or Path in typing.get_args(declared[name].type)):
            value = Path(value)
        options[name] = value
    if "vocab_map" not in given and options["vocab_map"] is not None and not Path(options["vocab_map"]).exists():
        raise ConfigError(f"the run's vocab map {options['vocab_map']} (recorded in {path}) no longer exists",
                          "pass -v/--vocab-map with where it is now")
    return TrainConfig.from_options(**options)


def _check_room(trainer: Trainer) -> None:
    """Before the first step: room for the next checkpoint (written beside the last before that one is
    removed): the trainable weights and AdamW's two moments, in fp32. The ranks stop together."""
    output = Path(trainer.cfg.runtime.output)
    need = sum(p.numel() for p in trainer.draft.parameters() if p.requires_grad) * 4 * 3
    free = shutil.disk_usage(output).free
    if distributed.any_rank(free < need):
        raise ArtifactError(f"{output} has {human_bytes(free)} free, and each checkpoint of this draft needs about "
                            f"{human_bytes(need)} (its weights and optimizer state)",
                            "free space there, or pass an -o on a disk with room (--resume continues a run "
                            "moved there)")


def _check_output(cfg: TrainConfig) -> None:
    """-o is a run folder of its own: not one of the run's inputs (nor inside one, nor holding one), not a
    folder of another kind (a cache, a model, an export, files of yours), before anything is written."""
    d, r = cfg.data, cfg.runtime
    if distributed.is_main():
        outputs.check({"-o": (r.output, outputs.TRAINING_RUN)},
                      {"--cache": d.cache, "--target": d.target, "--data": d.data, "--vocab-map": d.vocab_map,
                       "--chat-template": d.chat_template, "--stream-dir": r.stream_dir,
                       "--eval-prompts": r.eval_prompts, "--eval-engine-target": r.eval_engine_target})


def _check_run_dir(cfg: TrainConfig, run_json: dict) -> None:
    path = Path(cfg.runtime.output) / "run.json"
    latest = ckpt.latest_checkpoint(cfg.runtime.output)
    if latest is not None and not cfg.runtime.resume:
        raise ConfigError(f"{cfg.runtime.output} already holds checkpoints (latest {latest.name})",
                          "pass --resume to continue that run, or choose a new --output folder")
    if cfg.runtime.resume and path.is_file():
        before = json.loads(path.read_text())
        # an option newer than the run's spec_cli had its default value there
        defaults = {name: o.default for name, o in all_options().items()}
        resumable = resumable_options()
        for key in sorted(set(before["options"]) | set(run_json["options"])):
            if key in resumable or key in _LOCATION or key in _BY_CONTENT or key in _PER_STEP:  # a moved run resumes
                continue
            was, now = before["options"].get(key, defaults.get(key)), run_json["options"].get(key)
            if key in _PATHS and _same_path(was, now):
                continue
            if was != now:
                raise ConfigError(f"--resume with a different {key.replace('_', '-')}: the run used "
                                  f"{before['options'].get(key)!r}, now {run_json['options'].get(key)!r}",
                                  "resume with the run's options, or start a new run folder")
        for key, value in before["identity"].items():
            if run_json["identity"].get(key) != value:
                raise ArtifactError(f"--resume against a different {key.replace('_', ' ')}",
                                    "resume with the same target/cache and vocab map")
        for key in ("max_steps", "epochs"):  # the schedule's length: its warmup and decay are laid over it
            flag, was, now = all_options()[key].flag.names[0], before["options"].get(key), run_json["options"].get(key)
            if key in before["options"] and was != now and not cfg.runtime.reschedule:
                raise ConfigError(f"--resume with {flag} {now}: the run's schedule was laid over {flag} {was} and "
                                  f"its learning rate would jump", f"drop {flag} to finish the run's schedule, or "
                                  f"add --reschedule to lay it anew over {flag} {now}")


def _save_stream_report(cfg: TrainConfig, report: dict) -> None:
    """stream.json in the run folder (rank 0; also after an error or Ctrl-C) and one log line."""
    info(f"stream: {report['produced']} batches produced, {report['consumed']} consumed, peak "
         f"{report['peak_bytes'] / 2**20:.1f} MiB in the store, bound {size_text(report['max_bytes'])} "
         f"({report['max_bytes_source']}); the trainer waited "
         f"{report['trainer_wait_s']:.1f} s, producers {report['put_wait_s']:.1f} s on the bound")
    if distributed.is_main():
        try:
            write_json(Path(cfg.runtime.output) / "stream.json", report)
        except OSError as exc:  # never hide the error that ended the run
            info(f"could not write stream.json: {exc}")


