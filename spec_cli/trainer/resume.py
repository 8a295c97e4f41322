"""--resume: a run continued from its folder, with the options it was started with.

resumed_config  the options the user did not give, from the run's run.json (so `spec train --resume
                -o RUN` needs nothing retyped); refuses a --resume with no run to continue
kept_batch      over another number of processes than the checkpoint's, the --grad-accum that keeps
                the run's micro-batches a step (the data position and the schedule follow from them)
run_record      what run.json records: the options, flat, and what a --resume must match
check_run_dir   the options and identity a --resume gives, checked against run.json
"""

from __future__ import annotations

import json
import os
import typing
from pathlib import Path

from spec_cli import distributed
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts import guard
from spec_cli.console import info, warn
from spec_cli.errors import ArtifactError, ConfigError
from spec_cli.train_options import TrainConfig, all_options, resumable_options
from spec_cli.trainer.sources import Source

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
    """With --resume of a run that has run.json: the options the user did not give (`given`) taken
    from it, so `spec train --resume -o RUN` needs nothing retyped; the given ones are checked
    against it later (check_run_dir). `given` None: every option counts as given (the config as it
    is). Refuses a config without a vocab map (required but on --resume), or a resume whose recorded
    one has gone."""
    output = Path(cfg.runtime.output)
    path = output / "run.json"
    if cfg.runtime.resume and given is not None and path.is_file():
        cfg = _from_run_json(cfg, given, path)
    if cfg.runtime.resume and not path.is_file():
        kind = guard.folder_kind(output)
        what = (
            f"{output} does not exist"
            if not output.exists()
            else f"{output} is {kind}"
            if kind
            else f"{output} holds no run (no run.json)"
        )
        if cfg.data.vocab_map is None or kind is not None:
            raise ConfigError(
                f"--resume: there is no run to continue in {output}: {what}",
                "pass the folder of the run to continue as -o, or drop --resume and give the "
                "inputs to start a run",
            )
        if distributed.is_main():  # a requeued job whose first attempt never got going: start it
            warn(f"--resume: {what}; starting the run there at step 0")
    if cfg.data.vocab_map is None:
        raise ConfigError(
            "--vocab-map is required (with --resume, the run's own is used)",
            "pass the vocab map written by `spec build-vocab-map`",
        )
    return cfg


def kept_batch(cfg: TrainConfig, given: set[str] | None) -> TrainConfig:
    """--resume over another number of processes (torchrun ranks) than the checkpoint was saved by: each
    optimizer step still takes the run's micro-batches (processes x --grad-accum, the effective batch,
    which the data position and the schedule's length follow from), so --grad-accum becomes what keeps
    them, and one line says so. Refused when the processes cannot split them evenly, or when a typed
    --grad-accum (`given`; None: all of them) would change them."""
    state = _resumed_state(Path(cfg.runtime.output)) if cfg.runtime.resume else None
    world, context = distributed.world_size(), cfg.runtime.context_parallel
    if (
        state is None or world % context
    ):  # (Schedule.plan refuses a --context-parallel that does not divide)
        return cfg
    per_step, was_world = state["micro_batches_done"] // state["step"], state.get("world_size", 1)
    replicas, accum = world // context, cfg.optim.grad_accum
    trained = (
        f"the run's steps take {_many(per_step, 'micro-batch')} ({_many(was_world, 'process')} x "
        f"--grad-accum {state.get('grad_accum', '?')})"
    )
    if per_step % replicas:
        can = [str(n * context) for n in range(1, per_step + 1) if per_step % n == 0]
        listed = " or ".join(filter(None, [", ".join(can[:-1]), can[-1]]))  # 1, 2, 4 or 8
        raise ConfigError(
            f"--resume over {_many(world, 'process')}: {trained}, which {replicas} data-parallel "
            "replicas cannot split evenly",
            f"resume over {listed} process{'es' if can != ['1'] else ''} (torchrun --nproc-per-node)",
        )
    needed = per_step // replicas
    if needed != accum and (given is None or "grad_accum" in given):
        raise ConfigError(
            f"--resume with --grad-accum {accum} over {_many(world, 'process')}: "
            f"{_many(accum * replicas, 'micro-batch')} a step, and {trained}",
            f"drop --grad-accum (--grad-accum {needed} keeps the run's batch here), or start a "
            "new run folder",
        )
    if needed != accum or world != was_world:
        info(
            f"--resume over {_many(world, 'process')} of a run trained over {was_world}: --grad-accum {needed} "
            f"keeps its {_many(per_step, 'micro-batch')} a step"
        )
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
        raise ArtifactError(
            f"{path} cannot be read ({exc})",
            "resume needs the run.json spec train wrote; start a new run folder",
        ) from None
    source_typed = any(name in given for name in _SOURCES)
    options, declared = cfg.options(), all_options()
    for name, value in recorded.items():
        if name in given or name not in declared or name in _LOCATION or name in _PER_INVOCATION:
            continue
        if source_typed and name in _SOURCES:
            continue
        if value is not None and (
            declared[name].type is Path or Path in typing.get_args(declared[name].type)
        ):
            value = Path(value)
        options[name] = value
    if (
        "vocab_map" not in given
        and options["vocab_map"] is not None
        and not Path(options["vocab_map"]).exists()
    ):
        raise ConfigError(
            f"the run's vocab map {options['vocab_map']} (recorded in {path}) no longer exists",
            "pass -v/--vocab-map with where it is now",
        )
    return TrainConfig.from_options(**options)


def run_record(cfg: TrainConfig, source: Source, vocab_map) -> dict:
    """What run.json records: the options, flat (never the token), and what a --resume must match."""
    options = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.options().items() if k != "token"
    }
    return {
        "options": options,
        "identity": {**source.identity, "vocab_map_fingerprint": vocab_map.fingerprint},
    }


def check_run_dir(cfg: TrainConfig, run_json: dict) -> None:
    """A folder with checkpoints is refused without --resume; with it, run.json's options and
    identity are compared with this run's (`run_json`): an option that may not change
    (train_options' `resumable`), the target, cache or vocab map, and the schedule's length without
    --reschedule."""
    path = Path(cfg.runtime.output) / "run.json"
    latest = ckpt.latest_checkpoint(cfg.runtime.output)
    if latest is not None and not cfg.runtime.resume:
        raise ConfigError(
            f"{cfg.runtime.output} already holds checkpoints (latest {latest.name})",
            "pass --resume to continue that run, or choose a new --output folder",
        )
    if cfg.runtime.resume and path.is_file():
        before = json.loads(path.read_text())
        # an option newer than the run's spec_cli had its default value there
        defaults = {name: o.default for name, o in all_options().items()}
        resumable = resumable_options()
        for key in sorted(set(before["options"]) | set(run_json["options"])):
            if (
                key in resumable or key in _LOCATION or key in _BY_CONTENT or key in _PER_STEP
            ):  # a moved run resumes
                continue
            was, now = before["options"].get(key, defaults.get(key)), run_json["options"].get(key)
            if key in _PATHS and _same_path(was, now):
                continue
            if was != now:
                raise ConfigError(
                    f"--resume with a different {key.replace('_', '-')}: the run used "
                    f"{before['options'].get(key)!r}, now {run_json['options'].get(key)!r}",
                    "resume with the run's options, or start a new run folder",
                )
        for key, value in before["identity"].items():
            if run_json["identity"].get(key) != value:
                raise ArtifactError(
                    f"--resume against a different {key.replace('_', ' ')}",
                    "resume with the same target/cache and vocab map",
                )
        for key in (
            "max_steps",
            "epochs",
        ):  # the schedule's length: its warmup and decay are laid over it
            flag, was, now = (
                all_options()[key].flag.names[0],
                before["options"].get(key),
                run_json["options"].get(key),
            )
            if key in before["options"] and was != now and not cfg.runtime.reschedule:
                raise ConfigError(
                    f"--resume with {flag} {now}: the run's schedule was laid over {flag} {was} and "
                    f"its learning rate would jump",
                    f"drop {flag} to finish the run's schedule, or "
                    f"add --reschedule to lay it anew over {flag} {now}",
                )
