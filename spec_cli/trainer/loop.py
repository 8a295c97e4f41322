"""`train_loop`: the optimizer steps from where the run is to the end of its schedule.

A step (`_step`): the schedule's learning rate, --grad-accum micro-batches (the ranks share
gradients on the last), one host wait that reads the losses, the tokens and the ranks' stop and
timed-save requests together, a non-finite loss refused before the update, the update. After it, as
the step's number says: a train record, an evaluation, a checkpoint, a hand-over to the engine in
the loop. The last step always logs, evaluates and saves, and so does the step --max-time runs out
at.

A stop signal (spec_cli/stopping.py) only asks: the step in flight finishes, every rank stops after
the same step, logs it and saves it if the save fits in --stop-grace, and Stopped is raised. A
second signal, or the grace running out mid-step, abandons the step: one process saves the finished
steps if that fits, else the last checkpoint stands.
"""

from __future__ import annotations

import bisect
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli import distributed
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.console import info, warn
from spec_cli.draft.optim import lr_at
from spec_cli.errors import TrainingError
from spec_cli.stopping import SIGNAL_NAMES, Stopped, StopRequests, signal_name
from spec_cli.trainer import checkpoints
from spec_cli.trainer.engine import hand_over
from spec_cli.trainer.engine_process import wait_limit
from spec_cli.trainer.log import TrainLogger
from spec_cli.trainer.metrics import Metrics, metric_steps, train_record
from spec_cli.trainer.sources import Source
from spec_cli.trainer.trainer import Trainer


@dataclass
class LoopState:
    """What the loop carries from one step to the next."""

    step: int  # optimizer steps done
    window: Metrics  # the sums of the steps since the last train record
    window_start: float  # when that window began (time.perf_counter)
    last_saved: int  # the step of the newest checkpoint (at the start: the one resumed from, or 0)
    saved_at: float  # when the loop began or last saved (time.monotonic; --save-every-minutes)
    final_train: dict | None = None  # the last train record logged
    final_eval: dict | None = None  # the last evaluation's metrics


def train_loop(
    trainer: Trainer, batches, logger: TrainLogger, step: int, after_step=None, engine=None
) -> tuple[int, dict | None, dict | None]:
    """Optimizer steps from `step` to the end of the schedule, or until --max-time; (the step
    reached, the last train and eval records). A stop signal (Ctrl-C, SIGTERM) finishes the step in
    flight, logs and saves the finished steps (all ranks at the same step) and raises Stopped
    (spec_cli/stopping.py). `after_step(step)` is called after each optimizer step (tests use it).
    `engine` (rank 0, --eval-engine): the EngineEvaluator the weights are handed to every
    --eval-engine-every steps; its answers are logged as they come, and the last step's is waited
    for."""
    rt = trainer.cfg.runtime
    with StopRequests(rt.stop_grace) as stops:
        return _loop(trainer, batches, logger, step, after_step, engine, stops)


def _loop(
    trainer: Trainer,
    batches,
    logger: TrainLogger,
    step: int,
    after_step,
    engine,
    stops: StopRequests,
) -> tuple[int, dict | None, dict | None]:
    cfg, total = trainer.cfg, trainer.schedule.total_steps
    o, rt = cfg.optim, cfg.runtime
    engine_every = rt.eval_engine_every if rt.eval_engine else 0
    state = LoopState(
        step, _window(trainer), time.perf_counter(), last_saved=step, saved_at=time.monotonic()
    )
    loop_start, out_of_time = time.perf_counter(), False
    try:
        while state.step < total and not out_of_time:
            tokens, stop, due = _step(trainer, batches, state, stops)
            logger.step(tokens)
            if stop:  # a rank was signalled: every rank stops after this same step
                stops.answered()
                # its record first: a resume continues after the saved step and never logs it
                logger.log(_record(trainer, state, engine))
                _stop(trainer, state, stops)
            if after_step is not None:
                after_step(state.step)

            if o.max_time is not None and state.step < total:
                out_of_time = distributed.any_rank(time.perf_counter() - loop_start >= o.max_time)
                if out_of_time:
                    info(
                        f"--max-time {o.max_time:g}s reached after step {state.step} of {total}; "
                        f"saving (rerun with --resume to continue the schedule)"
                    )
            last = state.step == total or out_of_time  # the last step logs, evaluates and saves
            evaluating = (rt.eval_every and state.step % rt.eval_every == 0) or last
            # a stop that came during the step: it is logged and saved now, not after an evaluation
            stopping = evaluating and distributed.any_rank(stops.requested)
            if state.step % rt.log_every == 0 or last or stopping:
                state.final_train = _record(trainer, state, engine)
                logger.log(state.final_train)
                state.window, state.window_start = _window(trainer), time.perf_counter()
            if stopping:
                stops.answered()
                _stop(trainer, state, stops)
            if evaluating:
                state.final_eval = trainer.evaluate()
                if state.final_eval is not None:
                    logger.log({"split": "eval", "step": state.step, **state.final_eval})
            if state.step % rt.save_every == 0 or last or due:
                begun = time.monotonic()
                checkpoints.save(trainer, state.step)
                state.last_saved, state.saved_at = state.step, time.monotonic()
                stops.save_seconds = time.monotonic() - begun
            evaluated = engine_every and (state.step % engine_every == 0 or last)
            if evaluated:
                hand_over(trainer, state.step, engine, last)
            if engine is not None:
                engine.poll()  # answers that came back meanwhile: logged, RUN/best kept (never waits)
            if evaluated and (last or rt.eval_engine_wait):
                # the last checkpoint's evaluation (and any before it) comes back before the run ends; the
                # other ranks wait for rank 0 on their own barrier, not in a collective's timeout
                if engine is not None:
                    engine.finish()
                distributed.wait_for_main(
                    f"the engine's evaluation of step {state.step}", wait_limit()
                )
    except TrainingError:
        raise  # nothing saved: the state after a non-finite loss is not worth keeping
    except (
        KeyboardInterrupt
    ) as exc:  # a second signal, or the grace ran out mid-step: the step is abandoned
        if not stops.stopped:  # (else _stop saved what it could and said so)
            _abandoned(trainer, state, stops, exc)
        raise
    return state.step, state.final_train, state.final_eval


def _window(trainer: Trainer) -> Metrics:
    """The empty sums of a new window of steps."""
    return Metrics(
        metric_steps(trainer.cfg, trainer.algorithm), trainer.device, trainer.schedule.context
    )


def _record(trainer: Trainer, state: LoopState, engine) -> dict:
    """The train record of the window so far (every rank calls it: the sums are reduced)."""
    return train_record(trainer, state.window, state.window_start, state.step, engine)


def _step(
    trainer: Trainer, batches, state: LoopState, stops: StopRequests
) -> tuple[int, float, float]:
    """Optimizer step state.step + 1: (this rank's tokens, a stop asked, a timed save due), the last
    two agreed by the ranks (0 or 1). The step is counted together with its update."""
    o, rt, schedule = trainer.cfg.optim, trainer.cfg.runtime, trainer.schedule
    step = state.step
    trainer.set_lr(lr_at(step, schedule.total_steps, o))
    losses, tokens = [], []  # on the device: the host waits once per step, not per micro-batch
    for micro in range(o.grad_accum):
        batch = batches.get(step * o.grad_accum + micro)
        out = trainer.forward_backward(batch, sync=micro == o.grad_accum - 1)
        losses.append(out.loss.detach().double().reshape(1))
        tokens.append(batch.attention_mask.sum().double().reshape(1))
        state.window.add(out, tokens[-1])
    losses = torch.cat(losses)
    if (
        schedule.context > 1
    ):  # a group's ranks hold shares of one batch: a NaN in any stops them all
        torch.distributed.all_reduce(losses, group=trainer.objective.context.group)
    due = (
        rt.save_every_minutes is not None
        and time.monotonic() - state.saved_at >= rt.save_every_minutes * 60
    )
    asked = _asked(stops.requested, due, trainer.device)  # [stop, save], agreed by the ranks
    # the host's one wait of the step: the losses, the tokens and the requests together
    *losses, step_tokens, stop, due = torch.cat(
        [losses, torch.cat(tokens).sum().reshape(1), asked]
    ).tolist()
    bad = next((i for i, value in enumerate(losses) if not math.isfinite(value)), None)
    if bad is not None:  # before the optimizer step: the weights stay the last good ones
        raise _bad_loss(trainer, step + 1, step * o.grad_accum + bad, losses[bad])
    with stops.shielded():  # the update and its count go together (an abandon saves `state.step`)
        state.window.add_grad_norm(trainer.optimizer_step())
        state.step += 1
    return int(step_tokens), stop, due


def _asked(stop: bool, save: bool, device: torch.device) -> torch.Tensor:
    """[a stop signal came, a timed save is due] as 0/1 on `device`, each the largest over the ranks: made
    and reduced without the host waiting (the step's one sync reads it)."""
    asked = torch.zeros(2, dtype=torch.float64, device=device)
    if stop:
        asked[0].fill_(1.0)
    if save:
        asked[1].fill_(1.0)
    return distributed.max_in_place(asked)


# ----------------------------------------------------------------------------- stopping


def _stop(trainer: Trainer, state: LoopState, stops: StopRequests) -> None:
    """Every rank after the same step: save it if the save fits in the grace period (the ranks
    agree), say how to go on, and raise Stopped."""
    step, last_saved = state.step, state.last_saved
    signum = (
        stops.signum if stops.signum is not None else signal.SIGTERM
    )  # (a rank that had no signal)
    name, output = SIGNAL_NAMES.get(signum, f"signal {signum}"), trainer.cfg.runtime.output
    if step > last_saved and not distributed.any_rank(not stops.save_fits()):
        saved = checkpoints.save(trainer, step)
        if saved is not None:
            info(
                f"stopped by {name} after step {step}: saved {saved}; rerun with --resume to continue"
            )
    elif step > last_saved:
        if distributed.is_main():
            warn(
                f"stopped by {name} after step {step}: saving takes about {stops.save_seconds or 0:.0f} s and "
                f"{max(stops.left(), 0):.0f} s of --stop-grace {stops.grace:g} are left, so the last checkpoint "
                f"({_latest_name(output)}) stands; rerun with --resume to continue from it"
            )
    elif distributed.is_main():
        info(
            f"stopped by {name} after step {step}, which is saved; rerun with --resume to continue"
        )
    stops.stopped = True
    raise Stopped(signum)


def _abandoned(
    trainer: Trainer, state: LoopState, stops: StopRequests, exc: KeyboardInterrupt
) -> None:
    """The step in flight was cut off: one process saves the finished steps if that fits (the ranks of
    torchrun are at different points, so they keep the last checkpoint)."""
    step, last_saved = state.step, state.last_saved
    name, output = signal_name(exc), trainer.cfg.runtime.output
    if step > last_saved and distributed.world_size() == 1 and stops.save_fits():
        saved = checkpoints.save(trainer, step)
        if saved is not None:
            info(f"interrupted by {name}: saved {saved}; rerun with --resume to continue")
    elif step > last_saved and distributed.is_main():
        why = (
            f"no time left in --stop-grace {stops.grace:g} to save them"
            if distributed.world_size() == 1
            else "the ranks were cut off at different points"
        )
        info(
            f"interrupted by {name} with {step} steps done ({why}): the last checkpoint "
            f"({_latest_name(output)}) stands; rerun with --resume to continue from it"
        )
    elif distributed.is_main():
        info(
            f"interrupted by {name} with {step} steps done, all saved; rerun with --resume to continue"
        )


def _latest_name(output: Path) -> str:
    latest = ckpt.latest_checkpoint(output)
    return "none yet: a rerun starts at step 0" if latest is None else latest.name


# ----------------------------------------------------------------------------- a non-finite loss


def _bad_loss(trainer: Trainer, step: int, micro_batch: int, loss: float) -> TrainingError:
    """The error for a non-finite loss at optimizer `step`: which supervision it came from, and the way out."""
    cfg = trainer.cfg
    kept = ckpt.latest_checkpoint(cfg.runtime.output)
    keep = (
        f"; the last good checkpoint {kept} is kept"
        if kept is not None
        else "; no checkpoint was written"
    )
    if cfg.data.cache is not None:
        shards = _shards_of(trainer.source, trainer.schedule.indices(micro_batch))
        where = (
            f"from {', '.join(str(Path(cfg.data.cache) / name) for name in shards)}"
            if shards
            else f"from the feature cache {cfg.data.cache}"
        )
        return TrainingError(
            f"step {step}: the loss is {loss} on a batch {where}{keep}",
            f"check it with `spec inspect {cfg.data.cache} --verify` and rebuild the cache "
            f"with `spec precompute ... -o {cfg.data.cache} --no-resume`, then rerun "
            "(--resume continues from the checkpoint)",
        )
    return TrainingError(
        f"step {step}: the loss is {loss}{keep}",
        "lower --lr or check the target's outputs (--dtype), then rerun "
        "(--resume continues from the checkpoint)",
    )


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
