"""`spec demo`: every stage on the built-in assets (SmolLM2-135M target, ShareGPT, MT-bench).

assets -> regenerate (SmolLM2 answers the ShareGPT prompts itself, greedy; where vLLM answers, it also
keeps the feature cache and builds the vocab map as it answers: one pass of the target per answer) ->
training data (the regenerated conversations; without vLLM, plus the next ShareGPT conversations as
they are, which a prefill supervises at a fraction of generation's cost) -> build-vocab-map ->
precompute (both made already in one pass) -> train (its sized steps) -> export (vLLM,
self-checked) -> eval on MT-bench -> eval on held-out ShareGPT prompts (conversations the draft never
saw) -> tune. Each stage writes into one demo folder and is skipped when its artifact is already
complete, so a rerun (or a run after Ctrl-C) picks up where the last one stopped: regenerate keeps its
finished parts (and the rows' states kept for the cache), precompute its verified shards, train
resumes from its latest checkpoint.

The default demo is sized to `--minutes` (clock.size): its answers and steps follow this machine's
speeds, measured before the first stage, and the steps are sized again once the data is made. The
sizing is kept in demo.json, so a rerun continues the same run. `--quick` is fixed work.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from spec_cli import assets
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts import feature_cache as fc
from spec_cli.artifacts import outputs
from spec_cli.artifacts.io import atomic_path, write_json
from spec_cli.console import info
from spec_cli.errors import ConfigError, SpecError
from spec_cli.paths import spec_home
from spec_cli.targets import loading

DEMO_JSON = "demo.json"
STAGES = 11  # (10 without vLLM: no eval-vllm)


@dataclass(frozen=True)
class Profile:
    """The demo's work. `quick` is fixed; the default's samples, steps and engine_every are replaced by
    its sizing to --minutes (clock.size), and those written below are what its fixed-work form ran."""

    name: str
    samples: int  # ShareGPT conversations the target answers itself (regenerate), then trained on
    max_length: int  # tokens per conversation
    regen_max_new_tokens: int  # tokens per regenerated answer at most
    draft_vocab_size: int
    ttt_steps: int
    batch_tokens: int  # packed rows of this many tokens per optimizer step
    steps: int  # optimizer steps of batch_tokens packed tokens (a fixed time, whatever the data's size)
    lr: float
    eval_prompts: int  # MT-bench questions (both turns), spread over the categories
    eval_max_new_tokens: int
    heldout_prompts: int  # ShareGPT conversations after the regenerated ones (first two user turns)
    expected_minutes: float  # minutes it is sized for on 2 bf16-native CPU cores (in demo.json)
    eval_depth: int = 3
    original_samples: int = (
        0  # further ShareGPT conversations trained on with their original answers
    )
    expected_minutes_avx2: float = 0.0  # ... and on 2 cores with AVX2 only
    schedule: str = "cosine"  # spec train --schedule (docs/recipe.md: what the levers measured)
    optimizer: str = "adamw"  # spec train --optimizer
    # the MT-bench eval also decodes chains of these depths (spec eval --compare-depths; "auto": the
    # shorter ones this machine verifies measurably cheaper): which is fastest depends on the hardware
    eval_compare_depths: tuple[int, ...] | str = "auto"
    # the engine in the training loop (spec train --eval-engine, vLLM when installed): every this many
    # steps it decodes these many held-out conversations (both turns, this many tokens a turn), and the
    # checkpoint that accepted best is the one exported (--keep best)
    engine_every: int = 200
    engine_prompts: int = 8
    engine_tokens: int = 48
    # the closing `spec tune` (vLLM: 0 .. tune_max_k draft tokens at tune_batch_sizes)
    tune_max_k: int = 3
    tune_requests: int = 4
    tune_tokens: int = 32
    tune_repeats: int = 2
    tune_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)  # vLLM: the concurrent requests measured
    # where vLLM answers: this many prompts instead of samples + original_samples, and regenerate keeps the
    # feature cache as it answers (spec regenerate --features: one pass of the target per answer); none
    # as written (docs/recipe.md: the written half teaches nothing the target's answers do not)
    one_pass_samples: int = 0
    one_pass: bool = (
        False  # set by for_engine: this run's data is one_pass_samples answered in one pass
    )
    # `spec demo --minutes`: the minutes this run is sized to (0: the profile as written, --quick), and
    # whether samples and steps are sized yet (clock.size, from this machine's measured speeds)
    minutes: float = 0.0
    sized: bool = False

    def for_engine(self, engine: str) -> Profile:
        """The profile as a run with this regenerate engine carries it out."""
        if engine != "vllm" or not self.one_pass_samples or self.one_pass:
            return self
        return replace(self, samples=self.one_pass_samples, original_samples=0, one_pass=True)

    def describe(self) -> str:
        original = f" + {self.original_samples} as written" if self.original_samples else ""
        one_pass = ", the cache kept as it answers" if self.one_pass else ""
        return (
            f"{self.samples:,} ShareGPT prompts answered by the target itself{one_pass}{original} (<= {self.max_length} "
            f"tokens each), Vd {self.draft_vocab_size}, TTT {self.ttt_steps}, {self.steps:,} steps "
            f"({self.optimizer}, {self.schedule}), eval on {self.eval_prompts} MT-bench questions and "
            f"{self.heldout_prompts} held-out ShareGPT conversations"
        )


PROFILES = {
    "quick": Profile(
        "quick",
        samples=48,
        original_samples=100,
        max_length=256,
        regen_max_new_tokens=192,
        draft_vocab_size=4096,
        ttt_steps=3,
        batch_tokens=2048,
        steps=130,
        lr=1e-3,
        eval_prompts=4,
        eval_max_new_tokens=32,
        heldout_prompts=4,
        expected_minutes=8,
        expected_minutes_avx2=9,
        schedule="wsd",
        engine_every=130,
        engine_prompts=4,
        engine_tokens=32,
        tune_repeats=1,
        one_pass_samples=96,
        eval_compare_depths=(),
        tune_max_k=2,
        tune_batch_sizes=(1, 4, 16),
    ),
    "full": Profile(
        "full",
        samples=320,
        original_samples=1300,
        max_length=256,
        regen_max_new_tokens=192,
        draft_vocab_size=4096,
        ttt_steps=3,
        batch_tokens=2048,
        steps=1000,
        lr=1e-3,
        eval_prompts=8,
        eval_max_new_tokens=64,
        heldout_prompts=8,
        expected_minutes=40,
        expected_minutes_avx2=50,
        schedule="wsd",
        engine_every=250,
        one_pass_samples=1100,
    ),
}


DEFAULT_MINUTES = 30.0  # spec demo --minutes


@dataclass
class DemoConfig:
    quick: bool = False
    # the default demo's length: its answers and steps are sized to end near this many minutes on this
    # machine (None: DEFAULT_MINUTES; --quick is sized in work, not minutes)
    minutes: float | None = None
    output: Path | None = None  # default: SPEC_HOME/demo/<profile>
    install: bool = True  # pip-install the built-in assets when missing
    device: str | None = None
    dtype: str | None = None
    max_time: float | None = (
        None  # seconds: stop training early (a weaker draft, warned about); None: no cap
    )
    engine: str = (
        "auto"  # what runs the target in regenerate: auto (vLLM when installed), transformers, vllm
    )

    @property
    def profile(self) -> Profile:
        if self.quick:
            return PROFILES["quick"]
        return replace(PROFILES["full"], minutes=self.budget)

    @property
    def budget(self) -> float:
        return DEFAULT_MINUTES if self.minutes is None else float(self.minutes)

    def folder(self) -> Path:
        if self.output:
            return Path(self.output)
        name = self.profile.name
        if not self.quick and self.budget != DEFAULT_MINUTES:  # one folder per budget
            name += f"-{self.budget:g}min"
        return spec_home() / "demo" / name


@dataclass
class StageRecord:
    name: str
    status: str  # ran | reused | resumed
    seconds: float
    artifact: Path
    # the run that produced the artifact (this one unless reused): {"status", "seconds", "at"}
    produced: dict | None = None


@dataclass
class DemoResult:
    folder: Path
    profile: Profile
    stages: list[StageRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    acceptance_length: float | None = None
    speedup: float | None = None
    heldout_acceptance_length: float | None = None
    heldout_speedup: float | None = None
    speed_note: str = ""  # the per-turn spread of each eval's speed-up (report.spread_text)
    heldout_speed_note: str = ""
    fastest: dict | None = (
        None  # MT-bench: the fastest chain of those compared {"depth", "acceptance_length", "speedup"}
    )
    train_steps: str = ""
    # the engine in the loop: its answers ({"step", "acceptance_length", ...}), and the step exported
    engine_curve: list[dict] = field(default_factory=list)
    exported_step: int | None = None
    last_step: int | None = None
    tune: dict | None = (
        None  # the closing spec tune: {"engine", "table", "recommended", "serve", ...}
    )
    vllm: dict | None = (
        None  # MT-bench in vLLM: acceptance_length, speedup, both sides' tokens/s, note
    )
    torch_tps: dict | None = None  # MT-bench in PyTorch: both sides' tokens/s
    missing: str = ""  # what the demo cannot show without vLLM (said at the start and in the table)
    eval_json: Path | None = None
    serve_command: str = ""
    seconds: float = 0.0
    estimate: dict | None = (
        None  # measured at the start: this machine's speeds and the stages' minutes
    )
    speeds: object | None = None  # the start probe's clock.Speeds (None when every stage was done)
    compared: int | None = None  # the shorter chains the MT-bench eval decodes (the probe's count)

    def artifact(self, name: str) -> Path:
        return next(s.artifact for s in self.stages if s.name == name)


def run(cfg: DemoConfig) -> DemoResult:
    start = time.perf_counter()
    if cfg.engine not in ("auto", "transformers", "vllm"):  # before the folder is claimed
        raise ConfigError(f"unknown --engine {cfg.engine!r}", "use auto, transformers or vllm")
    if cfg.quick and cfg.minutes is not None:
        raise ConfigError(
            "--minutes sizes the default demo; --quick is the pipeline's smoke test, sized in work",
            "drop --quick to get the best draft those minutes buy, or drop --minutes",
        )
    if cfg.minutes is not None and not 0 < cfg.minutes < math.inf:  # nan and inf included
        raise ConfigError(f"--minutes {cfg.minutes:g} is not a length", "e.g. --minutes 30")
    profile, folder = cfg.profile.for_engine(regen_engine(cfg)), cfg.folder()
    outputs.check({"-o": (folder, outputs.DEMO)}, {})
    earlier = _produced(folder)  # before _claim_folder rewrites demo.json
    profile = _claim_folder(folder, profile)
    result = DemoResult(folder=folder, profile=profile)
    if profile.minutes and not profile.sized:
        info(
            f"spec demo ({profile.name}, {profile.minutes:g} minutes): its answers and steps are sized "
            f"to this machine's speed, measured next; artifacts in {folder}"
        )
    else:
        info(f"spec demo ({profile.name}): {profile.describe()}; artifacts in {folder}")
    if (
        eval_engine(cfg) == "torch" and cfg.engine == "auto"
    ):  # said once: what the demo cannot show here
        result.missing = (
            f"vLLM is not installed, so regenerate runs in transformers (about 2x slower), the "
            "training loop's evaluations and the closing tune run spec_cli's PyTorch decoder (one "
            "request at a time), and the speed-ups are the PyTorch evaluator's, not what a vLLM "
            f"server gets; for those: {_VLLM_INSTALL}"
        )
        info(result.missing)

    def stage(name: str, artifact: Path, work) -> None:
        t0 = time.perf_counter()
        info(f"[{len(result.stages) + 1}/{STAGES}] {name}")
        status = work()
        seconds = time.perf_counter() - t0
        if (
            status == "reused" and name in earlier
        ):  # keep the real time and result of the run that made it
            produced = earlier[name]
        else:
            produced = {
                "status": status,
                "seconds": round(seconds, 1),
                "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
        result.stages.append(StageRecord(name, status, seconds, artifact, produced))
        _record(folder, profile, result)

    found: dict = {}
    stage("assets", assets.assets_dir(), lambda: _assets(cfg, found))
    profile = _estimate(cfg, profile, found, earlier, result, start)
    result.profile = profile
    _record(folder, profile, result)  # the sizing, so that a rerun continues the same run
    regenerated = folder / "regenerated.jsonl"
    vocab_map = folder / f"vocab-{profile.draft_vocab_size}.safetensors"
    cache = folder / "cache"
    stage(
        "regenerate",
        regenerated,
        lambda: _regenerate(cfg, profile, found, regenerated, vocab_map, cache),
    )
    _revise(result)
    # one pass: the vocab map and the cache were made by regenerate (this run's, unless it was reused)
    made_in_regenerate = (
        "in regenerate" if profile.one_pass and result.stages[-1].status != "reused" else None
    )
    data = folder / "train.jsonl"
    stage("training data", data, lambda: _training_data(profile, found, regenerated, data))
    # the draft vocabulary from what the target itself writes (what it must predict when served): the
    # originals' other wording would take slots from the target's own tokens (docs/results.md)
    stage(
        "build-vocab-map",
        vocab_map,
        lambda: _vocab_map(profile, found, regenerated, vocab_map, made_in_regenerate),
    )
    stage(
        "precompute",
        cache,
        lambda: _precompute(cfg, profile, found, data, vocab_map, cache, made_in_regenerate),
    )
    run_dir = folder / "run"
    if profile.sized and result.speeds is not None and ckpt.latest_checkpoint(run_dir) is None:
        profile = result.profile = _resize_steps(cfg, profile, result, start)
    stage("train", run_dir, lambda: _train(cfg, profile, vocab_map, cache, run_dir, result))
    export_dir = folder / "export-vllm"
    stage("export", export_dir, lambda: _export(run_dir, export_dir, found, result))
    eval_dir = folder / "eval"
    stage("eval", eval_dir, lambda: _eval(cfg, profile, found, export_dir, eval_dir, result))
    if eval_engine(cfg) == "vllm":  # the same MT-bench turns in vLLM: the speed-up a server gets
        vllm_dir = folder / "eval-vllm"
        stage(
            "eval-vllm",
            vllm_dir,
            lambda: _eval_vllm(cfg, profile, found, export_dir, vllm_dir, result),
        )
    heldout_dir = folder / "eval-heldout"
    stage(
        "eval-heldout",
        heldout_dir,
        lambda: _eval(
            cfg,
            profile,
            found,
            export_dir,
            heldout_dir,
            result,
            heldout=_heldout_prompts(profile, found, data, folder),
        ),
    )
    tune_dir = folder / "tune"
    stage("tune", tune_dir, lambda: _tune(cfg, profile, found, export_dir, tune_dir, result))
    result.seconds = time.perf_counter() - start
    _record(folder, profile, result)
    return result


# ----------------------------------------------------------------------------- stages


def data_dtype(cfg: DemoConfig) -> str | None:
    """The target's dtype in regenerate and precompute: --dtype when given, else bf16 where it is native
    (a GPU, or a CPU with AMX / AVX512-BF16), where it makes both stages faster, else the stages'
    default (fp32 on a CPU).
    Eval keeps --dtype (fp32 on a CPU): there bf16 verifies several tokens in what one step costs,
    but its one-token step is slower than fp32's (transformers' linears repack the weights each
    call), so a bf16 speed-up would be over a slower target than the user can have (figures:
    docs/results.md)."""
    if cfg.dtype:
        return cfg.dtype
    return "bf16" if loading.fast_bf16(loading.choose_device(cfg.device)) else None


def _estimate(
    cfg: DemoConfig, profile: Profile, found: dict, earlier: dict, result: DemoResult, start: float
) -> Profile:
    """This machine's speed at each kind of step, measured now (spec_cli/stages/demo/clock.py), and the
    minutes the stages not yet done will take at it (result.estimate; None when every stage is done).
    A profile with minutes and not yet sized is sized here (clock.size) to end near them, counted from
    `start`; the profile is returned as the run carries it out."""
    from spec_cli.stages.demo import clock as demo_clock

    stages = (
        "regenerate",
        "precompute",
        "train",
        "eval",
        *(("eval-vllm",) if eval_engine(cfg) == "vllm" else ()),
        "eval-heldout",
        "tune",
    )
    left = [name for name in stages if name not in earlier]
    if not left:
        return profile
    import torch

    from spec_cli import threads

    device = loading.choose_device(cfg.device)
    t0 = time.perf_counter()
    meter = (
        threads.Meter()
    )  # a crowded machine measures slow speeds, and so a long estimate: say so
    speeds = demo_clock.measure(
        loading.resolve_target(found["smollm2"]),
        device,
        loading.choose_dtype(data_dtype(cfg), device),
        loading.choose_dtype(cfg.dtype, device),
        profile.draft_vocab_size,
        profile.batch_tokens,
        profile.ttt_steps,
    )
    compared = None
    if "eval" in left and profile.eval_compare_depths == "auto":
        compared = demo_clock.chains_compared(
            loading.resolve_target(found["smollm2"]),
            device,
            loading.choose_dtype(cfg.dtype, device),
            profile.eval_depth,
        )
    busy = meter.stop(
        torch.get_num_threads(), threads.available_cores(), on_cpu=device.type == "cpu"
    )
    result.speeds, result.compared = speeds, compared
    sizing = None
    if profile.minutes and not profile.sized:
        profile, sizing = _size(cfg, profile, speeds, compared, time.perf_counter() - start)
    per_stage = demo_clock.stage_seconds(
        profile, speeds, regen_engine(cfg), compared, eval_engine(cfg)
    )
    seconds = {name: per_stage[name] for name in left if name in per_stage}
    total = (sum(seconds.values()) + per_stage["fixed"]) / 60
    info(
        f"this machine, measured in {time.perf_counter() - t0:.0f} s: {speeds.text()}; so the stages left "
        f"take about {total:.0f} min ("
        + ", ".join(f"{n} {s / 60:.1f}" for n, s in seconds.items())
        + ")"
        + (
            f". WARNING: {busy['warning']}; this estimate assumes the machine stays that busy (the demo "
            "states its total again after regenerate and after 50 training steps)"
            if busy["too_busy"]
            else ""
        )
    )
    result.estimate = {
        "minutes": round(total, 1),
        "stages": {n: round(s, 2) for n, s in seconds.items()},
        "speeds": {k: round(v, 1) for k, v in asdict(speeds).items()},
        "busy": {k: busy.get(k) for k in ("too_busy", "warning", "cpu_share", "other_load")},
        **({"sizing": sizing} if sizing else {}),
    }
    return profile


def _size(
    cfg: DemoConfig, profile: Profile, speeds, compared: int | None, spent: float
) -> tuple[Profile, dict]:
    """The profile's answers and steps for its minutes, less the `spent` seconds (assets, the probe),
    on a machine of these speeds; said, with what twice the minutes would buy here."""
    from spec_cli.stages.demo import clock as demo_clock

    def fit(minutes: float) -> Profile:
        return demo_clock.size(
            profile, speeds, minutes * 60 - spent, regen_engine(cfg), compared, eval_engine(cfg)
        )

    try:
        chosen = fit(profile.minutes)
    except ValueError as smallest:
        need = (float(smallest.args[0]) + spent) / 60
        raise ConfigError(
            f"--minutes {profile.minutes:g} is too few for the demo on this machine: its smallest run "
            f"({demo_clock.MIN_ANSWERS} answers, {demo_clock.MIN_STEPS} steps, the evals and the "
            f"tune) takes about {need:.0f} minutes here",
            f"use --minutes {math.ceil(need)} or more, or --quick for the pipeline's smoke test",
        ) from None
    more = fit(2 * profile.minutes)
    sizing = {
        "minutes": profile.minutes,
        "answers": chosen.samples,
        "steps": chosen.steps,
        "passes": demo_clock.PASSES,
        "more": {"minutes": 2 * profile.minutes, "answers": more.samples, "steps": more.steps},
    }
    info(
        f"sized to {profile.minutes:g} minutes on this machine: {chosen.describe()}; "
        f"--minutes {2 * profile.minutes:g} would answer {more.samples:,} prompts and train "
        f"{more.steps:,} steps (docs/recipe.md: what answers and steps buy)"
    )
    return chosen, sizing


def _resize_steps(cfg: DemoConfig, profile: Profile, result: DemoResult, start: float) -> Profile:
    """Before training starts: the steps sized again to the minutes left, now that the data stages have
    run (their real time replaces their estimate). Only when this run made its data itself: a rerun
    that found it made keeps the steps it was sized with."""
    from spec_cli.stages.demo import clock as demo_clock

    made = {s.name: s.status for s in result.stages}
    if made.get("regenerate") != "ran":
        return profile
    left = profile.minutes * 60 - (time.perf_counter() - start)
    steps = demo_clock.steps_for(profile, result.speeds, left, eval_engine(cfg), result.compared)
    if steps == profile.steps:
        return profile
    resized = demo_clock.sized(profile, profile.samples, steps)
    if result.estimate is not None:
        result.estimate["resized_steps"] = {"from": profile.steps, "to": steps}
    info(
        f"the data took {sum(s.seconds for s in result.stages) / 60:.1f} min: training takes "
        f"{steps:,} steps (sized {profile.steps:,} at the start) so that the demo ends near its "
        f"{profile.minutes:g} minutes"
    )
    return resized


def _revise(result: DemoResult) -> None:
    """After regenerate ran: its real time in place of its estimate. vLLM's speed does not follow from the
    transformers decode the clock measures (docs/results.md), so the total is stated again with the
    minutes regenerate took."""
    estimate, done = result.estimate, result.stages[-1]
    if not estimate or "regenerate" not in estimate["stages"] or done.status != "ran":
        return
    took = done.seconds / 60
    left = (
        estimate["minutes"] - estimate["stages"]["regenerate"] / 60
    )  # the other stages and the fixed part
    estimate["revised_minutes"] = round(sum(s.seconds for s in result.stages) / 60 + left, 1)
    info(
        f"regenerate took {took:.1f} min (estimated {estimate['stages']['regenerate'] / 60:.1f}); the stages left "
        f"take about {left:.0f} min, the whole demo about {estimate['revised_minutes']:g}"
    )


class TrainPace:
    """The demo's `after_step` in training: once PACE_STEPS steps (or a third of those left) have run,
    the stage's time at the pace measured (its start, the evals and checkpoints every 50 steps included)
    and the demo's total with it, printed and kept in the estimate (`train_paced_minutes`,
    `paced_minutes`). The clock's calibration before the first stage cannot see how fast this machine
    reads the feature cache beside the step (fitted once per CPU class); the stage itself can."""

    def __init__(
        self,
        result: DemoResult,
        total: int,
        first: int,
        clock=time.perf_counter,
        engine_at: tuple[int, ...] = (),
        engine_each: float = 0.0,
    ):
        """engine_at: the steps after which the engine in the loop evaluates; engine_each: the seconds
        one evaluation adds to the stage (the clock's). Those still to come when the pace is taken are
        added to it: the steps before it ran without them."""
        self.result, self.total, self.first, self.clock = result, total, first, clock
        self.engine_at, self.engine_each = tuple(engine_at), engine_each
        self.start = clock()
        self.at = first + min(PACE_STEPS, max(1, (total - first) // 3))

    def __call__(self, step: int) -> None:
        if step != self.at or step >= self.total:
            return
        ran = self.clock() - self.start
        evaluations = sum(
            step <= s <= self.total for s in self.engine_at
        )  # (after_step comes first)
        stage = ran * (self.total - self.first) / (step - self.first)
        stage += evaluations * self.engine_each
        estimate = self.result.estimate
        line = (
            f"training: {step - self.first} steps in {ran / 60:.1f} min, so the stage takes about "
            f"{stage / 60:.1f} min at this pace"
            + (
                f" with the engine's {evaluations} evaluation(s) to come"
                if evaluations and self.engine_each
                else ""
            )
        )
        if estimate and "train" in estimate["stages"]:
            done = sum(
                s.seconds for s in self.result.stages
            )  # the stages before this one, as they ran
            later = estimate["minutes"] * 60 - sum(
                estimate["stages"].get(n, 0.0) for n in EARLIER_THAN_EVAL
            )
            estimate["train_paced_minutes"] = round(stage / 60, 1)
            estimate["paced_minutes"] = round((done + stage + later) / 60, 1)
            line += (
                f" (estimated {estimate['stages']['train'] / 60:.1f}); the whole demo about "
                f"{estimate['paced_minutes']:g} min"
            )
        info(line)


def _engine_pace(result: DemoResult, profile: Profile) -> dict:
    """TrainPace's engine_at and engine_each for this run: the clock's seconds per evaluation at the
    speeds measured at the start (none when this run measured none)."""
    from spec_cli.stages.demo import clock as demo_clock

    if result.speeds is None:
        return {}
    return dict(
        engine_at=tuple(demo_clock.engine_steps(profile)),
        engine_each=demo_clock.engine_seconds(profile, result.speeds),
    )


PACE_STEPS = (
    50  # training steps timed before the demo states its total again (one eval and save among them)
)
EARLIER_THAN_EVAL = (
    "regenerate",
    "precompute",
    "train",
)  # the estimate's stages that run before train ends


def regen_engine(cfg: DemoConfig) -> str:
    """--engine auto: vLLM where it is installed (the `vllm` extra: it answers the demo's prompts faster
    than transformers' generate), else transformers."""
    if cfg.engine != "auto":
        return cfg.engine
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


def _assets(cfg: DemoConfig, found: dict) -> str:
    found.update(assets.ensure_all(install=cfg.install))
    return "ready"


def _regenerate(
    cfg: DemoConfig, profile: Profile, found: dict, path: Path, vocab_map: Path, cache: Path
) -> str:
    """The target's answers; with a one-pass profile (vLLM) also the feature cache, kept as it answers,
    and the vocab map it needs, built from the answers as the build-vocab-map stage builds it."""
    from spec_cli.stages import regenerate
    from spec_cli.ui import print_regenerate_summary

    engine = regen_engine(cfg)
    info(
        f"regenerate runs the target in {engine}"
        + (
            " (installed; --engine transformers runs it in transformers instead)"
            if engine == "vllm" and cfg.engine == "auto"
            else ""
        )
    )
    outcome = regenerate.run(
        regenerate.RegenerateConfig(
            target=str(found["smollm2"]),
            data=str(found["sharegpt"]),
            output=path,
            temperature=0.0,
            max_new_tokens=profile.regen_max_new_tokens,
            max_length=profile.max_length,
            max_samples=profile.samples,
            device=cfg.device,
            dtype=data_dtype(cfg),
            engine=engine,
            **(
                dict(features=cache, vocab_map=vocab_map, draft_vocab_size=profile.draft_vocab_size)
                if profile.one_pass
                else {}
            ),
        )
    )
    if outcome.already_complete:
        return "reused"
    print_regenerate_summary(outcome)
    return "resumed" if outcome.reused_parts else "ran"


def _jsonl_lines(path: Path) -> list[str]:
    """A JSON-lines file's lines, cut at newlines only: str.splitlines() also cuts at U+2028 and the
    other Unicode line breaks, which JSON strings written with ensure_ascii=False hold as they are
    (ShareGPT has them)."""
    return path.read_text(encoding="utf-8").split("\n")


def _last_source_index(data: Path) -> int:
    return max(
        (json.loads(line).get("source_index", -1) for line in _jsonl_lines(data) if line.strip()),
        default=-1,
    )


def _sharegpt_after(found: dict, used: int, count: int, keep_users: int | None = None):
    """The next `count` ShareGPT chat records after source index `used` (leading assistant messages
    dropped, as regenerate does; at most `keep_users` user turns), each with its source index."""
    from spec_cli.data import records

    if count <= 0:
        return
    with open(found["sharegpt"], encoding="utf-8") as f:
        for index, line in enumerate(f):
            if index <= used or not line.strip():
                continue
            try:
                kind, messages = records.normalise(json.loads(line))
            except (ValueError, SpecError):
                continue
            if kind != "chat":
                continue
            while messages and messages[0]["role"] == "assistant":
                messages = messages[1:]
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if not users or messages[users[0]]["content"].strip() == "":
                continue
            if keep_users is not None and len(users) > keep_users:
                messages = messages[: users[keep_users]]
            yield {"messages": messages, "source_index": index}
            count -= 1
            if count == 0:
                return


def _training_data(profile: Profile, found: dict, regenerated: Path, path: Path) -> str:
    """The regenerated conversations, then `original_samples` further ShareGPT conversations with
    their original answers (written once; a rerun with the same inputs reuses it)."""
    lines = [line for line in _jsonl_lines(regenerated) if line.strip()]
    used = _last_source_index(regenerated)
    lines += [
        json.dumps({**r, "source": "sharegpt"}, ensure_ascii=False)
        for r in _sharegpt_after(found, used, profile.original_samples)
    ]
    text = "".join(line + "\n" for line in lines)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return "reused"
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return "ran"


def _heldout_prompts(profile: Profile, found: dict, data: Path, folder: Path) -> Path:
    """ShareGPT conversations after the last one trained on (the draft never saw them), first two
    user turns each, written once into the demo folder."""
    path = folder / "heldout.jsonl"
    if path.is_file():
        return path
    chosen = [
        json.dumps(r, ensure_ascii=False)
        for r in _sharegpt_after(
            found, _last_source_index(data), profile.heldout_prompts, keep_users=2
        )
    ]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in chosen), encoding="utf-8")
    return path


def _vocab_map(
    profile: Profile, found: dict, data: Path, path: Path, made_by: str | None = None
) -> str:
    from spec_cli.artifacts.vocab_map import load_vocab_map
    from spec_cli.stages import build_vocab_map
    from spec_cli.ui import print_vocab_map_summary

    if path.is_file():
        try:
            made = load_vocab_map(path)
            if made.draft_vocab_size == profile.draft_vocab_size and made.metadata.get(
                "data"
            ) == str(data):
                return made_by or "reused"
        except SpecError:
            pass  # unreadable or stale: build it again (written atomically over it)
    result = build_vocab_map.run(
        build_vocab_map.BuildVocabMapConfig(
            target=str(found["smollm2"]),
            data=str(data),
            output=path,
            draft_vocab_size=profile.draft_vocab_size,
            max_length=profile.max_length,
            num_proc=2,
            force=True,
        )
    )  # the demo's own file under its folder
    print_vocab_map_summary(result)
    return "ran"


def _precompute(
    cfg: DemoConfig,
    profile: Profile,
    found: dict,
    data: Path,
    vocab_map: Path,
    cache: Path,
    made: str | None = None,
) -> str:
    from spec_cli.stages import precompute
    from spec_cli.ui import print_precompute_summary

    if (
        profile.one_pass
    ):  # regenerate wrote it as it answered (and writes it again if it is not complete)
        fc.check_files(cache, fc.read_manifest(cache))
        info(f"feature cache {cache}: written by regenerate as the target answered (one pass)")
        return made or "reused"
    partial = cache.is_dir() and any(cache.iterdir())
    result = precompute.run(
        precompute.PrecomputeConfig(
            target=str(found["smollm2"]),
            data=str(data),
            vocab_map=vocab_map,
            output=cache,
            max_length=profile.max_length,
            batch_tokens=8192,
            num_proc=2,
            device=cfg.device,
            dtype=data_dtype(cfg),
            resume=True,
        )
    )
    if result.computed_shards == 0 and (cache / fc.MANIFEST).is_file() and partial:
        return "reused"
    print_precompute_summary(result)
    return "resumed" if result.reused_shards else "ran"


def _train(
    cfg: DemoConfig,
    profile: Profile,
    vocab_map: Path,
    cache: Path,
    run_dir: Path,
    result: DemoResult,
) -> str:
    from spec_cli.stages import train
    from spec_cli.ui import print_train_summary

    latest = ckpt.latest_checkpoint(run_dir)
    if latest is not None:
        state = json.loads((latest / "trainer_state.json").read_text())
        if state["step"] >= state["total_steps"]:
            result.train_steps = f"{state['step']} of {state['total_steps']}"
            result.engine_curve = engine_curve(run_dir)
            return "reused"
    first = (
        json.loads((latest / "trainer_state.json").read_text())["step"] if latest is not None else 0
    )
    engine = eval_engine(cfg)
    info(
        f"training keeps the checkpoint that accepts best in {engine} (every {profile.engine_every} steps: "
        f"{profile.engine_prompts} held-out conversations, both turns), and exports that one"
    )
    outcome = train.run(
        train.TrainConfig.from_options(
            vocab_map=vocab_map,
            output=run_dir,
            cache=cache,
            pack=True,
            batch_tokens=profile.batch_tokens,
            ttt_steps=profile.ttt_steps,
            lr=profile.lr,
            max_steps=profile.steps,
            fc_norm=True,
            schedule=profile.schedule,
            optimizer=profile.optimizer,
            eval_fraction=0.03,
            log_every=5,
            eval_every=50,
            save_every=50,
            eval_engine=engine,
            eval_engine_every=profile.engine_every,
            keep="best",
            eval_engine_prompts=profile.engine_prompts,
            eval_engine_tokens=profile.engine_tokens,
            eval_engine_depth=profile.eval_depth,
            max_time=cfg.max_time,
            resume=latest is not None,
            device=cfg.device,
            dtype=cfg.dtype,
        ),
        after_step=TrainPace(result, profile.steps, first, **_engine_pace(result, profile)),
    )
    result.engine_curve = engine_curve(run_dir)
    print_train_summary(outcome)
    result.train_steps = f"{outcome.steps} of {outcome.total_steps}"
    if outcome.steps < outcome.total_steps:  # the draft is weaker than the profile's: say so loudly
        result.warnings.append(
            f"training stopped by --max-time at step {outcome.steps} of "
            f"{outcome.total_steps}: the draft is weaker than this profile's; rerun "
            "`spec demo` (without --max-time) to finish the schedule"
        )
    return "resumed" if latest is not None else "ran"


def _export(run_dir: Path, export_dir: Path, found: dict, result: DemoResult) -> str:
    """The run's best checkpoint (RUN/best: what the engine in the loop measured best), else its latest."""
    from spec_cli.console import summary
    from spec_cli.stages import export

    chosen = ckpt.resolve_checkpoint(run_dir)
    step = json.loads((chosen / "trainer_state.json").read_text())["step"]
    latest = ckpt.latest_checkpoint(run_dir)
    result.exported_step = step
    result.last_step = (
        json.loads((latest / "trainer_state.json").read_text())["step"] if latest else step
    )
    config = export_dir / "config.json"
    if config.is_file():
        recorded = json.loads(config.read_text()).get("spec_cli", {})
        if recorded.get("checkpoint") == str(chosen) and recorded.get("step") == step:
            result.serve_command = _serve_command(export_dir)
            return "reused"
    outcome = export.run(
        export.ExportConfig(
            source=run_dir,
            format="vllm",
            output=export_dir,
            check=True,
            target=str(found["smollm2"]),
            overwrite=True,
        )
    )
    summary("export", outcome.summary_rows())
    result.serve_command = outcome.serve_command
    return "ran"


_VLLM_INSTALL = (
    "pip install -e '.[vllm]' && pip uninstall -y torchvision torchaudio torchcodec (a CPU "
    "machine; on a GPU machine, pip install vllm for your torch)"
)


def _eval_vllm(
    cfg: DemoConfig,
    profile: Profile,
    found: dict,
    export_dir: Path,
    eval_dir: Path,
    result: DemoResult,
) -> str:
    """MT-bench in vLLM: the PyTorch eval's turns, chain and tokens, the target alone beside the draft in
    vLLM, acceptance from vLLM's own counters: the demo's headline speed-up."""
    from spec_cli.eval.report import print_table, spread_text
    from spec_cli.stages import eval as evaluate

    settings = {
        "depth": profile.eval_depth,
        "topk": 1,
        "max_new_tokens": profile.eval_max_new_tokens,
        "num_prompts": profile.eval_prompts,
        "prompts": str(found["mt-bench"]),
        "engine": "vllm",
    }
    step = json.loads((export_dir / "config.json").read_text())["spec_cli"]["step"]
    report = eval_dir / "eval.json"

    def keep(overall: dict, busy: dict | None) -> None:
        result.vllm = {
            k: overall[k]
            for k in ("acceptance_length", "speedup", "spec_tokens_per_s", "target_tokens_per_s")
        }
        result.vllm["note"] = spread_text(overall.get("speedup_spread"))
        if (busy or {}).get("warning"):
            result.warnings.append(f"MT-bench eval in vLLM: {busy['warning']}")

    if report.is_file():
        done = json.loads(report.read_text())
        if done["draft"]["step"] == step and all(
            done["settings"].get(k) == v for k, v in settings.items()
        ):
            keep(done["overall"], done.get("busy"))
            return "reused"
    outcome = evaluate.run(
        evaluate.EvalConfig(
            target=str(found["smollm2"]),
            draft=export_dir,
            prompts=str(found["mt-bench"]),
            output=eval_dir,
            depth=profile.eval_depth,
            topk=1,
            max_new_tokens=profile.eval_max_new_tokens,
            num_prompts=profile.eval_prompts,
            device=cfg.device,
            dtype=cfg.dtype,
            engine="vllm",
        )
    )
    print_table(outcome)
    keep(outcome.overall, outcome.busy)
    return "ran"


def eval_engine(cfg: DemoConfig) -> str:
    """The engine that measures acceptance in the training loop and tunes the export: vLLM as --engine
    says (auto: where it is installed; it is what users deploy), else spec_cli's PyTorch decoder."""
    return "vllm" if regen_engine(cfg) == "vllm" else "torch"


def engine_curve(run_dir: Path) -> list[dict]:
    """The engine's answers in the run's log.jsonl: step, acceptance length, speed-up, whether kept."""
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        return []
    curve = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("split") == "engine" and "error" not in record:
            curve[record["step"]] = {
                k: record.get(k)
                for k in ("step", "engine", "acceptance_length", "speedup", "best", "seconds")
            }
    return [curve[s] for s in sorted(curve)]


def _tune(
    cfg: DemoConfig,
    profile: Profile,
    found: dict,
    export_dir: Path,
    tune_dir: Path,
    result: DemoResult,
) -> str:
    """`spec tune` of the exported draft: vLLM's tokens/s with 0 .. tune_max_k draft tokens at batch sizes
    1 .. 16 (the PyTorch decoder's chains at batch 1 without vLLM) and the schedule that was fastest."""
    from spec_cli.stages import tune

    step = json.loads((export_dir / "config.json").read_text())["spec_cli"]["step"]
    engine = eval_engine(cfg)
    report = tune_dir / "serving.json"
    settings = {
        "max_k": profile.tune_max_k,
        "requests": profile.tune_requests,
        "max_new_tokens": profile.tune_tokens,
        "repeats": profile.tune_repeats,
    }
    sizes = list(profile.tune_batch_sizes) if engine == "vllm" else None  # PyTorch: batch 1
    if report.is_file():
        done = json.loads(report.read_text())
        if (
            done["draft"]["step"] == step
            and done["engine"] == engine
            and all(done["settings"].get(k) == v for k, v in settings.items())
            and done["settings"].get("batch_sizes_asked") == sizes
        ):
            result.tune = done
            return "reused"
    outcome = tune.run(
        tune.TuneConfig(
            draft=export_dir,
            target=str(found["smollm2"]),
            output=tune_dir,
            engine=engine,
            device=cfg.device,
            dtype=cfg.dtype,
            fit_sizes=True,
            batch_sizes=None if sizes is None else tuple(sizes),
            **settings,
        )
    )
    tune.print_tune(outcome)
    result.tune = json.loads(report.read_text())
    return "ran"


def _eval(
    cfg: DemoConfig,
    profile: Profile,
    found: dict,
    export_dir: Path,
    eval_dir: Path,
    result: DemoResult,
    heldout: Path | None = None,
) -> str:
    """MT-bench, or with `heldout` those prompts (the second eval row of the demo's table)."""
    from spec_cli.eval.report import print_table, spread_text
    from spec_cli.stages import eval as evaluate

    prompts = str(heldout) if heldout is not None else str(found["mt-bench"])
    count = profile.heldout_prompts if heldout is not None else profile.eval_prompts
    compare = () if heldout is not None else profile.eval_compare_depths
    settings = {
        "depth": profile.eval_depth,
        "topk": 1,
        "max_new_tokens": profile.eval_max_new_tokens,
        "num_prompts": count,
        "prompts": prompts,
        **(
            {"compare_depths_asked": compare}
            if compare == "auto"
            else {"compare_depths": sorted(d for d in set(compare) if d != profile.eval_depth)}
        ),
        "dtype": str(loading.choose_dtype(cfg.dtype, loading.choose_device(cfg.device))).replace(
            "torch.", ""
        ),
    }
    step = json.loads((export_dir / "config.json").read_text())["spec_cli"]["step"]
    report = eval_dir / "eval.json"

    def keep(overall: dict, busy: dict | None, depths: dict | None = None) -> None:
        note = spread_text(overall.get("speedup_spread"))
        if depths:
            best = evaluate.fastest_depth(depths)
            result.fastest = {
                "depth": best,
                "acceptance_length": depths[best]["acceptance_length"],
                "speedup": depths[best]["speedup"],
                "compared": sorted(d for d in depths if d != profile.eval_depth),
            }
        if heldout is not None:
            result.heldout_acceptance_length, result.heldout_speedup = (
                overall["acceptance_length"],
                overall["speedup"],
            )
            result.heldout_speed_note = note
        else:
            result.eval_json = report
            result.acceptance_length, result.speedup = (
                overall["acceptance_length"],
                overall["speedup"],
            )
            result.speed_note = note
            result.torch_tps = {
                k: overall.get(k) for k in ("spec_tokens_per_s", "target_tokens_per_s")
            }
        if (busy or {}).get("warning"):  # the speed-up above came from a crowded machine: say so
            which = "held-out" if heldout is not None else "MT-bench"
            result.warnings.append(f"{which} eval: {busy['warning']}")

    if report.is_file():
        done = json.loads(report.read_text())
        before = {
            "compare_depths": [],
            **done["settings"],
        }  # an eval.json from before --compare-depths
        if done["draft"]["step"] == step and all(before.get(k) == v for k, v in settings.items()):
            keep(
                done["overall"],
                done.get("busy"),
                {int(d): m for d, m in (done.get("depths") or {}).items()},
            )
            return "reused"
    outcome = evaluate.run(
        evaluate.EvalConfig(
            target=str(found["smollm2"]),
            draft=export_dir,
            prompts=prompts,
            output=eval_dir,
            depth=profile.eval_depth,
            topk=1,
            max_new_tokens=profile.eval_max_new_tokens,
            num_prompts=count,
            device=cfg.device,
            dtype=cfg.dtype,
            compare_depths=compare if compare == "auto" else tuple(compare),
        )
    )
    print_table(outcome)
    keep(outcome.overall, outcome.busy, outcome.depths)
    return "ran"


# ----------------------------------------------------------------------------- bookkeeping


def _serve_command(export_dir: Path) -> str:
    """The vLLM command from the export's README (the first `vllm serve` line)."""
    readme = export_dir / "README.md"
    if readme.is_file():
        for line in readme.read_text().splitlines():
            if line.strip().startswith("vllm serve"):
                return line.strip()
    return ""


# set by clock.size (engine_every follows the steps)
SIZED = ("samples", "original_samples", "one_pass_samples", "steps", "engine_every", "sized")


def _claim_folder(folder: Path, profile: Profile) -> Profile:
    """A demo folder belongs to one profile: the stages' artifacts would refuse to mix anyway, but
    saying so up front is clearer than a mismatch deep inside precompute. A folder sized to the same
    minutes continues with its sizing (its answers and steps), not a new one."""
    record = folder / DEMO_JSON
    if record.is_file():
        before = json.loads(record.read_text()).get("profile", {})
        now = asdict(profile)
        if before.get("sized") and before.get("minutes") == profile.minutes:
            profile = replace(profile, **{k: before[k] for k in SIZED if k in before})
            now = asdict(profile)
        elif profile.minutes and "minutes" in before and not before.get("sized"):
            # claimed by a sized run that stopped before its sizing: nothing was made for it yet
            before, now = (
                {k: v for k, v in d.items() if k not in SIZED and k != "minutes"}
                for d in (before, now)
            )
        if before.get("name") != profile.name or _shaping(before) != _shaping(now):
            sized_to = f", sized to {before['minutes']:g} minutes" if before.get("minutes") else ""
            raise ConfigError(
                f"{folder} holds a demo with other settings ({before.get('name')}{sized_to})",
                "use another --output folder, or delete that one to start over"
                + (f"; --minutes {before['minutes']:g} continues it" if sized_to else ""),
            )
    elif folder.is_dir() and any(folder.iterdir()):
        raise ConfigError(
            f"{folder} is not empty and holds no {DEMO_JSON}",
            "give `spec demo --output` a new or empty folder",
        )
    folder.mkdir(parents=True, exist_ok=True)
    write_json(record, {"kind": "demo", "profile": asdict(profile), "stages": []})
    return profile


def _shaping(profile: dict) -> dict:
    """A profile's fields that shape its artifacts: all but the stated duration, the depths the eval
    compares (the eval reruns when its own settings differ) and the engine's and tune's settings (a
    finished run is kept; tune reruns when its settings differ), so that a new estimate or comparison in
    a release does not disown a folder whose stages it would make the same."""
    return {
        k: v
        for k, v in {"minutes": 0.0, "sized": False, **profile}.items()  # fields older folders lack
        if not k.startswith(("expected_minutes", "engine_", "tune_")) and k != "eval_compare_depths"
    }


def _produced(folder: Path) -> dict[str, dict]:
    """stage -> how its artifact was produced, from the folder's demo.json (empty if none)."""
    try:
        stages = json.loads((folder / DEMO_JSON).read_text()).get("stages", [])
    except (OSError, ValueError, AttributeError):
        return {}
    out = {}
    for s in stages:
        if isinstance(s, dict) and s.get("name"):
            out[s["name"]] = s.get("produced") or {
                "status": s.get("status"),
                "seconds": s.get("seconds"),
            }
    return out


def _record(folder: Path, profile: Profile, result: DemoResult) -> None:
    write_json(
        folder / DEMO_JSON,
        {
            "kind": "demo",
            "profile": asdict(profile),
            "stages": [
                {
                    "name": s.name,
                    "status": s.status,
                    "seconds": round(s.seconds, 1),
                    "artifact": str(s.artifact),
                    "produced": s.produced,
                }
                for s in result.stages
            ],
            "acceptance_length": result.acceptance_length,
            "speedup": result.speedup,
            "heldout": {
                "acceptance_length": result.heldout_acceptance_length,
                "speedup": result.heldout_speedup,
            },
            "fastest_chain": result.fastest,
            "vllm": result.vllm,
            "torch_tokens_per_s": result.torch_tps,
            "engine_curve": result.engine_curve,
            "exported_step": result.exported_step,
            "last_step": result.last_step,
            "tune": None
            if result.tune is None
            else {
                k: result.tune.get(k)
                for k in ("engine", "speculative_config", "decoding", "why", "verified")
            },
            "estimate": result.estimate,
            "seconds": round(result.seconds, 1),
        },
    )
