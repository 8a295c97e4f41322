"""`spec train`'s options: five small groups, each option declared once, on its field.

A field's metadata holds its command-line declaration (names, help, --help panel, click's checks such
as min=, and a parser for text like `4G` or `45m`); `spec_cli/cli.py` makes the `train` command's
parameters from these fields, in this order. Adding an option is one field here plus its use. The
options other stages share (--vocab-map, --device, ...) are declared once in cli.py; their fields say
`shared(...)`. The objective's options are ObjectiveOptions' (spec_cli/draft/algorithm.py), declared
here as ObjectiveFlags.

run.json records the options flat (`TrainConfig.options()`: option name -> value), as every version
has, and `TrainConfig.from_options(lr=3e-3, ...)` builds a config from such names.

This module imports no model code: the CLI reads it to build its command.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from spec_cli.errors import ConfigError
from spec_cli.help import CHECKPOINTS, DATA, DRAFT, INPUTS, OBJECTIVE, OPTIMISATION, RUNTIME, TARGET

if TYPE_CHECKING:
    from spec_cli.draft.algorithm import ObjectiveOptions


def parse_duration(text: str | None, option: str) -> float | None:
    """'90s', '45m', '1.5h' or a bare number of minutes -> seconds."""
    if text is None:
        return None
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    raw = text.strip().lower()
    scale = units.get(raw[-1:], None)
    number = raw[:-1] if scale is not None else raw
    try:
        value = float(number) * (scale or 60.0)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{option} {text!r} is not a duration", "write e.g. 90s, 45m or 2h (a bare number "
                                                                   "is minutes)")
    return value


def parse_size(text: str, option: str) -> int:
    """'512M', '4G', '1.5g', '65536' -> bytes (K/M/G/T are powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(raw[-1:], None)
    try:
        value = float(raw[:-1] if scale else raw) * (scale or 1)
    except ValueError:
        value = 0.0
    if not (value >= 1 and math.isfinite(value)):
        raise ConfigError(f"{option} {text!r} is not a size", "write e.g. 512M, 4G or a number of bytes")
    return int(value)


@dataclass(frozen=True)
class Range:
    """The values a number option allows: finite, and within lo..hi (`open`: the bound itself excluded)."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def allows(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    @property
    def text(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return ""


POSITIVE = Range(0, lo_open=True)  # > 0
NON_NEGATIVE = Range(0)  # >= 0
FRACTION = Range(0, 1)  # [0, 1]


def check_range(name: str, value, allowed: Range | None) -> None:
    """Refuse (ConfigError naming the option and its range: one line, exit 1) a number option's value
    outside `allowed`; any float option must be finite (inf and nan are never a setting)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    allowed = allowed or Range()
    if not allowed.allows(float(value)):
        flag = "--" + name.replace("_", "-")
        must = f"a finite number {allowed.text}".rstrip()
        raise ConfigError(f"{flag} {value:g} is out of range", f"{flag} must be {must}")


@dataclass(frozen=True)
class Flag:
    """How one option is written on the command line."""
    names: tuple[str, ...]  # "--output", "-o"; a pair of flags as "--on/--off"
    help: str
    panel: str  # its --help panel (spec_cli.help)
    parse: Callable[[str | None, str], object] | None = None  # (text, option name) -> the field's value
    text: str | None = None  # with `parse`: the default as a user writes it ("4G")
    checks: dict = field(default_factory=dict)  # typer.Option's own: min=, max=, envvar=, file_okay=


def option(default, *names: str, help: str, panel: str, parse=None, text: str | None = None,
           resumable: bool = False, allowed: Range | None = None, **checks):
    """A config field that is a `spec train` option. resumable: it may differ on --resume (it does not
    change the math: how long, how often, where from, on what). allowed: a number option's range, checked
    by TrainConfig.from_options (a ConfigError naming the option: exit 1) and shown in --help; any float
    option must be finite."""
    if allowed is not None:
        help = f"{help} Allowed: {allowed.text}."
    return field(default=default, metadata={"flag": Flag(names, help, panel, parse, text, checks),
                                           "resumable": resumable, "allowed": allowed})


def shared(default, resumable: bool = False):
    """A field whose option every stage that takes it shares: declared once, in cli.py."""
    return field(default=default, metadata={"flag": None, "resumable": resumable, "allowed": None})


@dataclass(frozen=True)
class DataOptions:
    """Where the supervision comes from, and how the data is cut into batches."""
    vocab_map: Path | None = shared(None)  # required but on --resume (the run's own): train.resumed_config
    cache: Path | None = option(
        None, "--cache", help="Feature cache from `spec precompute` (no target needed).", panel=INPUTS)
    target: str | None = option(
        None, "--target", "-t", help="Live target instead of a cache: a transformers folder, a .gguf file, or "
                                     "`smollm2`. Needs --data.", panel=TARGET)
    data: str | None = option(
        None, "--data", "-d", help="Chat data for a live --target or --remote (as in build-vocab-map).",
        panel=TARGET)
    remote: str | None = option(
        None, "--remote", help="Targets served by `spec serve-target`: URL[,URL...]. Needs --data.",
        panel=TARGET, resumable=True)
    token: str | None = option(  # never written to run.json
        None, "--token", help="--remote: the servers' token. Default: $SPEC_SERVE_TOKEN.", panel=TARGET,
        envvar="SPEC_SERVE_TOKEN", resumable=True)
    chat_template: str | None = option(
        None, "--chat-template", help="Live --target / --remote: render conversations with this chat "
                                      "template (a Jinja file or chatml, llama3, gemma, mistral) instead of "
                                      "the target's own; as for build-vocab-map.", panel=TARGET)
    batch_tokens: int = option(
        8192, "--batch-tokens", help="Bound on B x padded length per micro-batch (a cache keeps its own "
                                     "batches unless --pack).", panel=DATA, min=1)
    pack: bool = option(
        False, "--pack", help="Pack several conversations per row (block-causal per document).", panel=DATA)
    eval_fraction: float = option(
        0.02, "--eval-fraction", help="Share of batches held out for evaluation.", panel=DATA,
        allowed=Range(0, 1, hi_open=True))
    max_length: int = shared(2048)
    max_samples: int | None = option(
        None, "--max-samples", help="Live target: use only the first N samples.", panel=DATA, min=1)
    num_proc: int = shared(1, resumable=True)


@dataclass(frozen=True)
class DraftOptions:
    """The draft's shape (the rest comes from the target's config) and its first weights."""
    draft_layers: int = option(
        1, "--draft-layers", help="Decoder layers in the draft (EAGLE-3: 1).", panel=DRAFT, min=1)
    draft_hidden_size: int | None = option(
        None, "--draft-hidden-size", help="Default: the target's hidden size.", panel=DRAFT)
    draft_intermediate_size: int | None = option(
        None, "--draft-intermediate-size", help="Default: the target's.", panel=DRAFT)
    draft_heads: int | None = option(None, "--draft-heads", help="Default: the target's.", panel=DRAFT)
    draft_kv_heads: int | None = option(None, "--draft-kv-heads", help="Default: the target's.", panel=DRAFT)
    fc_norm: bool = option(
        False, "--fc-norm", help="EAGLE-3.1: RMSNorm each aux state before fc.", panel=DRAFT)
    norm_output: bool = option(
        False, "--norm-output", help="EAGLE-3.1: feed the post-norm state to the next step.", panel=DRAFT)
    init_from_target: bool = option(  # (a --resume then loads its checkpoint over it)
        False, "--init-from-target/--random-init", help="Start the draft's lm_head and final norm from the "
                                                        "target's (its lm_head rows of the draft vocab) "
                                                        "instead of random. Measured slower to learn on "
                                                        "SmolLM2 (see CHANGELOG).", panel=DRAFT, resumable=True)
    draft_rope_theta: float | None = option(
        None, "--draft-rope-theta", help="Train the draft with plain rope at this theta instead of the target's "
                                         "rope (taken from the target by default, scaling included; needed only "
                                         "for a scaling type the draft does not compute).", panel=DRAFT,
        allowed=Range(1))
    algorithm: str = shared("eagle3")  # spec_cli/draft/algorithms.py
    aux_layers: str | None = shared(None)


@dataclass(frozen=True)
class ObjectiveFlags:
    """The options of ObjectiveOptions (spec_cli/draft/algorithm.py): the algorithms' own class, which
    TrainConfig.objective is; importing it would load torch into every `spec` command, so its options
    are declared here, with the same names and defaults (tests/stages/test_train_options.py)."""
    ttt_steps: int = option(7, "--ttt-steps", help="TTT unroll depth.", panel=OBJECTIVE, min=1)
    step_weight: float = option(
        0.8, "--step-weight", help="Weight of TTT step k is step_weight**k (normalised).", panel=OBJECTIVE,
        allowed=POSITIVE)
    loss: str = option(
        "soft-ce", "--loss", help="soft-ce, lk-alpha or lk-lambda (LK losses: arXiv 2602.23881).",
        panel=OBJECTIVE)
    lk_kl_scale: float = option(1.0, "--lk-kl-scale", help="lk-lambda: KL weight scale.", panel=OBJECTIVE,
                                allowed=NON_NEGATIVE)
    lk_kl_decay: float = option(1.0, "--lk-kl-decay", help="lk-lambda: KL weight decay.", panel=OBJECTIVE,
                                allowed=NON_NEGATIVE)
    feature_weight: float = option(
        1.0, "--feature-weight", help="--algorithm eagle: weight of SmoothL1 on the predicted next feature.",
        panel=OBJECTIVE, allowed=NON_NEGATIVE)
    token_weight: float = option(
        0.1, "--token-weight", help="--algorithm eagle: weight of soft-CE between the target's next-token "
                                    "distribution and the draft's (through the target's lm_head).",
        panel=OBJECTIVE, allowed=NON_NEGATIVE)
    cod_ratio: float = option(
        0.7, "--cod-ratio", help="--algorithm peagle: depth d trains on max(r**d, --cod-min) of its valid "
                                 "positions (COD sampling); --ttt-steps is the number of depths K.",
        panel=OBJECTIVE, allowed=FRACTION)
    cod_min: float = option(0.2, "--cod-min", help="--algorithm peagle: the floor of the COD share.",
                            panel=OBJECTIVE, allowed=FRACTION)
    peagle_segments: int = option(
        1, "--peagle-segments", help="--algorithm peagle: split each batch's rows into this many segments, "
                                     "each with its own forward and backward (less activation memory at long "
                                     "rows; the same loss and gradients).", panel=OBJECTIVE, min=1,
        resumable=True)


@dataclass(frozen=True)
class OptimOptions:
    """How the weights are updated, and for how long."""
    lr: float = option(2e-4, "--lr", help="Peak learning rate (AdamW, betas 0.9/0.95).", panel=OPTIMISATION,
                       allowed=POSITIVE)
    min_lr_ratio: float = option(
        0.0, "--min-lr-ratio", help="Cosine decay floor as a fraction of --lr.", panel=OPTIMISATION,
        allowed=FRACTION)
    warmup_ratio: float = option(
        0.03, "--warmup-ratio", help="Linear warmup as a fraction of the steps.", panel=OPTIMISATION,
        allowed=FRACTION)
    weight_decay: float = option(0.0, "--weight-decay", help="AdamW weight decay.", panel=OPTIMISATION,
                                 allowed=NON_NEGATIVE)
    grad_clip: float = option(
        0.5, "--grad-clip", help="Clip the gradient norm to this (0: off).", panel=OPTIMISATION,
        allowed=NON_NEGATIVE)
    grad_accum: int = option(
        1, "--grad-accum", help="Micro-batches per optimizer step (per process).", panel=OPTIMISATION, min=1)
    max_steps: int | None = option(
        None, "--max-steps", help="Optimizer steps to run. Default: --epochs over the data.",
        panel=OPTIMISATION, min=1, resumable=True)
    epochs: float = option(
        1.0, "--epochs", help="Passes over the training batches.", panel=OPTIMISATION, resumable=True,
        allowed=POSITIVE)
    max_time: float | None = option(  # seconds of the training loop; stop cleanly (checkpoint) when reached
        None, "--max-time", help="Stop cleanly (checkpoint saved) after this long, e.g. 90s, 45m, 2h (a bare "
                                 "number is minutes); --resume continues the schedule.", panel=OPTIMISATION,
        parse=parse_duration, resumable=True)
    seed: int = option(0, "--seed", help="Seed for init, data order and eval split.", panel=OPTIMISATION)


@dataclass(frozen=True)
class RuntimeOptions:
    """Where the run goes and what it runs on: output, devices, streaming, logs and checkpoints."""
    output: Path = option(
        MISSING, "--output", "-o", help="Run folder (checkpoints, logs, plot).", panel=INPUTS)
    prefetch: int = option(
        2, "--prefetch", help="--remote: requests in flight per client; --stream: batches the target runs "
                              "ahead of the trainer.", panel=TARGET, min=0, resumable=True)
    stream: bool = option(  # live target: producer threads run `prefetch` batches ahead, bounded
        False, "--stream", help="Live --target/--remote: run the target in producer threads ahead of the "
                                "trainer through a bounded store (same results as without).", panel=TARGET,
        resumable=True)
    stream_max_bytes: int = option(
        4 << 30, "--stream-max-bytes", help="--stream: supervision the store may hold (e.g. 512M, 4G, or "
                                            "bytes); producers wait beyond it.", panel=TARGET,
        parse=parse_size, text="4G", resumable=True)
    stream_dir: Path | None = option(
        None, "--stream-dir", help="--stream: keep samples as files in a folder made here (removed at the "
                                   "end) instead of in memory.", panel=TARGET, file_okay=False, resumable=True)
    fsdp: bool = option(  # torchrun: shard the draft (FSDP2) instead of replicating it (DDP)
        False, "--fsdp", help="Under torchrun: shard the draft's weights, gradients and optimizer state "
                              "across processes (FSDP2) instead of replicating them (DDP); for large "
                              "drafts.", panel=RUNTIME, resumable=True)
    activation_checkpointing: bool = option(
        False, "--activation-checkpointing", help="Recompute activations in backward (long sequences).",
        panel=RUNTIME, resumable=True)
    device: str | None = shared(None, resumable=True)
    dtype: str | None = shared(None)  # the live target's
    target_engine: str = shared("transformers", resumable=True)  # what runs a live --target
    log_every: int = option(
        10, "--log-every", help="Steps per log record.", panel=CHECKPOINTS, min=1, resumable=True)
    eval_every: int = option(
        200, "--eval-every", help="Steps between evaluations (0: only at the end).", panel=CHECKPOINTS,
        min=0, resumable=True)
    save_every: int = option(
        500, "--save-every", help="Steps between checkpoints (and at the end).", panel=CHECKPOINTS, min=1,
        resumable=True)
    keep_last: int = option(
        3, "--keep-last", help="Checkpoints to keep.", panel=CHECKPOINTS, min=1, resumable=True)
    resume: bool = option(
        False, "--resume", help="Continue the run in --output from its latest checkpoint.", panel=CHECKPOINTS,
        resumable=True)


@dataclass(frozen=True)
class TrainConfig:
    """What `spec train` runs with: cfg.data.cache, cfg.objective.ttt_steps, cfg.optim.lr, ..."""
    data: DataOptions
    draft: DraftOptions
    objective: ObjectiveOptions
    optim: OptimOptions
    runtime: RuntimeOptions

    @classmethod
    def from_options(cls, **options) -> TrainConfig:
        """A config from flat option values (vocab_map=..., output=..., lr=3e-3); the rest default."""
        from spec_cli.draft.algorithm import ObjectiveOptions

        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"TrainConfig has no option {', '.join(unknown)}")
        values: dict[str, dict] = {group: {} for group in GROUPS}
        for name, value in options.items():
            check_range(name, value, OPTIONS[name].allowed)
            values[OPTIONS[name].group][name] = value
        kinds = {**GROUPS, "objective": ObjectiveOptions}
        return cls(**{group: kinds[group](**values[group]) for group in GROUPS})

    def options(self) -> dict:
        """Every option by name, flat: what run.json records."""
        return {o.name: getattr(getattr(self, o.group), o.name) for o in OPTIONS.values()}


@dataclass(frozen=True)
class Option:
    """One `spec train` option, as the CLI and run.json see it."""
    name: str
    group: str  # the TrainConfig field that holds it
    type: object  # the field's type
    default: object  # MISSING: required
    flag: Flag | None  # None: shared with other stages, declared in cli.py
    resumable: bool
    allowed: Range | None  # a number option's range (any float option must be finite)


# TrainConfig's groups, by field; each is a dataclass of options (the objective's declared as ObjectiveFlags)
GROUPS: dict[str, type] = {"data": DataOptions, "draft": DraftOptions, "objective": ObjectiveFlags,
                           "optim": OptimOptions, "runtime": RuntimeOptions}


def _options() -> dict[str, Option]:
    out: dict[str, Option] = {}
    for group, kind in GROUPS.items():
        hints = typing.get_type_hints(kind)
        for f in dataclasses.fields(kind):
            if f.name in out:
                raise TypeError(f"option {f.name} is declared twice (in {out[f.name].group} and {group})")
            out[f.name] = Option(f.name, group, hints[f.name], f.default, f.metadata["flag"],
                                 f.metadata["resumable"], f.metadata["allowed"])
    return out


OPTIONS: dict[str, Option] = _options()  # name -> Option, in declaration order
RESUMABLE = frozenset(o.name for o in OPTIONS.values() if o.resumable)


def typed_options(ctx=None) -> set[str] | None:
    """The `spec train` options the user gave (on the command line, in the environment or in a --config
    file) rather than left at their defaults, from click's context (default: the current one); None when
    no `spec train` command is being run (then every option counts as given)."""
    if ctx is None:
        for package in ("typer._click.globals", "click.globals"):  # typer >= 0.2x runs its own click
            try:
                module = __import__(package, fromlist=["get_current_context"])
            except ImportError:
                continue
            ctx = module.get_current_context(silent=True)
            if ctx is not None:
                break
    if ctx is None or set(OPTIONS) - {p.name for p in ctx.command.params}:
        return None
    return {name for name in OPTIONS
            if (source := ctx.get_parameter_source(name)) is not None and source.name != "DEFAULT"}
