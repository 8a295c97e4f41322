"""`spec train`'s options: five small groups, each option declared once, on its field.

A field's metadata holds its command-line declaration (names, help, --help panel, click's checks such
as min=, and a parser for text like `4G` or `45m`: spec_cli/options.py); spec_cli/commands/train.py
makes the `train` command's parameters from these fields, in this order. Adding an option is one field
here plus its use. The options other stages share (--vocab-map, --device, ...) are declared once in
spec_cli/commands/options.py; their fields say `shared(...)`.

The objective group is the options every algorithm's objective reads (ObjectiveFlags) followed by each
registered algorithm's own (`Algorithm.options`, declared in its package): ObjectiveOptions holds them
all by name, so an algorithm added to spec_cli/draft/algorithms.py brings its options with it.

run.json records the options flat (`TrainConfig.options()`: option name -> value), as every version
has, and `TrainConfig.from_options(lr=3e-3, ...)` builds a config from such names.

This module imports no model code: the CLI reads it to build its command.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path

from spec_cli.help import (
    CHECKPOINTS,
    DATA,
    DRAFT,
    ENGINE_LOOP,
    INPUTS,
    OBJECTIVE,
    OPTIMISATION,
    RUNTIME,
    TARGET,
)
from spec_cli.options import (  # noqa: F401
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    Flag,
    Range,
    check_range,
    option,
    parse_duration,
    parse_size,
    parse_size_or_auto,
    shared,
)


@dataclass(frozen=True)
class DataOptions:
    """Where the supervision comes from, and how the data is cut into batches."""

    vocab_map: Path | None = shared(
        None
    )  # required but on --resume (the run's own): train.resumed_config
    cache: Path | None = option(
        None,
        "--cache",
        help="Feature cache from `spec precompute` (no target needed).",
        panel=INPUTS,
    )
    target: str | None = option(
        None,
        "--target",
        "-t",
        help="Live target instead of a cache: a transformers folder, a .gguf file, or "
        "`smollm2`. Needs --data.",
        panel=TARGET,
    )
    data: str | None = option(
        None,
        "--data",
        "-d",
        help="Chat data for a live --target or --remote (as in build-vocab-map).",
        panel=TARGET,
    )
    remote: str | None = option(
        None,
        "--remote",
        help="Targets served by `spec serve-target`: URL[,URL...]. Needs --data.",
        panel=TARGET,
        resumable=True,
    )
    token: str | None = option(  # never written to run.json
        None,
        "--token",
        help="--remote: the servers' token. Default: $SPEC_SERVE_TOKEN.",
        panel=TARGET,
        envvar="SPEC_SERVE_TOKEN",
        resumable=True,
    )
    tensor_plane: bool = option(
        True,
        "--tensor-plane/--no-tensor-plane",
        help="--remote: take the supervision over the servers' "
        "tensor plane (torch.distributed send/recv: NCCL onto this GPU, else gloo) when they offer one and "
        "it can be joined; else, or with --no-tensor-plane, in HTTP bodies. Same tensors either way.",
        panel=TARGET,
        resumable=True,
    )
    chat_template: str | None = option(
        None,
        "--chat-template",
        help="Live --target / --remote: render conversations with this chat "
        "template (a Jinja file or chatml, llama3, gemma, mistral) instead of "
        "the target's own; as for build-vocab-map.",
        panel=TARGET,
    )
    batch_tokens: int = option(
        8192,
        "--batch-tokens",
        help="Bound on B x padded length per micro-batch (a cache keeps its own "
        "batches unless --pack).",
        panel=DATA,
        min=1,
    )
    pack: bool = option(
        False,
        "--pack",
        help="Pack several conversations per row (block-causal per document).",
        panel=DATA,
    )
    eval_fraction: float = option(
        0.02,
        "--eval-fraction",
        help="Share of batches held out for evaluation.",
        panel=DATA,
        allowed=Range(0, 1, hi_open=True),
    )
    max_length: int = shared(2048)
    max_samples: int | None = option(
        None, "--max-samples", help="Live target: use only the first N samples.", panel=DATA, min=1
    )
    num_proc: int = shared(1, resumable=True)


@dataclass(frozen=True)
class DraftOptions:
    """The draft's shape (the rest comes from the target's config) and its first weights."""

    draft_layers: int = option(
        1, "--draft-layers", help="Decoder layers in the draft (EAGLE-3: 1).", panel=DRAFT, min=1
    )
    draft_hidden_size: int | None = option(
        None, "--draft-hidden-size", help="Default: the target's hidden size.", panel=DRAFT
    )
    draft_intermediate_size: int | None = option(
        None, "--draft-intermediate-size", help="Default: the target's.", panel=DRAFT
    )
    draft_heads: int | None = option(
        None, "--draft-heads", help="Default: the target's.", panel=DRAFT
    )
    draft_kv_heads: int | None = option(
        None, "--draft-kv-heads", help="Default: the target's.", panel=DRAFT
    )
    draft_window: int | None = option(
        None,
        "--draft-window",
        help="Sliding-window attention for the draft: each position attends the last N "
        "positions only, in training, `spec eval` and the vLLM exports "
        "(speculators trains 2048 by default). EAGLE-3. Default: the whole "
        "context.",
        panel=DRAFT,
        min=1,
    )
    fc_norm: bool = option(
        False, "--fc-norm", help="EAGLE-3.1: RMSNorm each aux state before fc.", panel=DRAFT
    )
    norm_output: bool = option(
        False,
        "--norm-output",
        help="EAGLE-3.1: feed the post-norm state to the next step.",
        panel=DRAFT,
    )
    init_from_target: bool = option(  # (a --resume then loads its checkpoint over it)
        False,
        "--init-from-target/--random-init",
        help="Start the draft's lm_head and final norm from the target's (its lm_head rows of the "
        "draft vocab) instead of random weights (the default; docs/recipe.md compares the two).",
        panel=DRAFT,
        resumable=True,
    )
    init_layer_from_target: bool = option(  # (a --resume then loads its checkpoint over it)
        False,
        "--init-layer-from-target",
        help="EAGLE-3: start the draft's decoder layer from the target's layer after its highest "
        "aux layer (read from the target's safetensors) and fc as a pass-through of that aux "
        "state, instead of random weights (the default; docs/recipe.md compares the two).",
        panel=DRAFT,
        resumable=True,
    )
    draft_rope_theta: float | None = option(
        None,
        "--draft-rope-theta",
        help="Train the draft with plain rope at this theta instead of the target's "
        "rope (taken from the target by default, scaling included; needed only "
        "for a scaling type the draft does not compute).",
        panel=DRAFT,
        allowed=Range(1),
    )
    algorithm: str = shared("eagle3")  # spec_cli/draft/algorithms.py
    aux_layers: str | None = shared(None)


@dataclass(frozen=True)
class ObjectiveFlags:
    """The objective options every algorithm reads (each algorithm's own follow: Algorithm.options)."""

    ttt_steps: int = option(
        3,
        "--ttt-steps",
        help="TTT unroll depth: the draft steps each position is trained on (P-EAGLE: its K "
        "parallel depths). Default: 3 for EAGLE-3, 7 for EAGLE-1/2, MSD and P-EAGLE. Deeper "
        "trains the later steps of longer chains at the cost of that many draft forwards a "
        "batch (docs/recipe.md).",
        panel=OBJECTIVE,
        min=1,
        show_default=False,
    )
    step_weight: float = option(
        0.8,
        "--step-weight",
        help="Weight of TTT step k is step_weight**k (normalised).",
        panel=OBJECTIVE,
        allowed=POSITIVE,
    )
    hidden_noise: float = option(
        0.0,
        "--hidden-noise",
        help="Train on the target's states plus Gaussian noise of this size relative "
        "to each state's RMS (e.g. 0.05; never in evaluation, eval or export).",
        panel=OBJECTIVE,
        allowed=NON_NEGATIVE,
    )
    loss: str = option(
        "soft-ce",
        "--loss",
        help="soft-ce, lk-alpha or lk-lambda (LK losses: arXiv 2602.23881).",
        panel=OBJECTIVE,
    )
    lk_kl_scale: float = option(
        1.0,
        "--lk-kl-scale",
        help="lk-lambda: KL weight scale.",
        panel=OBJECTIVE,
        allowed=NON_NEGATIVE,
    )
    lk_kl_decay: float = option(
        1.0,
        "--lk-kl-decay",
        help="lk-lambda: KL weight decay.",
        panel=OBJECTIVE,
        allowed=NON_NEGATIVE,
    )


@dataclass(frozen=True)
class OptimOptions:
    """How the weights are updated, and for how long."""

    lr: float = option(
        1e-3,
        "--lr",
        help="Peak learning rate (AdamW, betas 0.9/0.95). Default: 1e-3 for EAGLE-3, 2e-4 for "
        "the other algorithms.",
        panel=OPTIMISATION,
        allowed=POSITIVE,
        show_default=False,
    )
    optimizer: str = option(
        "adamw",
        "--optimizer",
        help="adamw, or muon: Muon (torch.optim.Muon, momentum 0.95, its update "
        "scaled to AdamW's RMS) for the draft's matrices, AdamW for norms, "
        "lm_head and embeddings.",
        panel=OPTIMISATION,
        allowed=("adamw", "muon"),
    )
    muon_lr: float | None = option(
        None,
        "--muon-lr",
        help="--optimizer muon: peak learning rate of the matrices. Default: --lr.",
        panel=OPTIMISATION,
        allowed=POSITIVE,
    )
    muon_weight_decay: float = option(
        0.1,
        "--muon-weight-decay",
        help="--optimizer muon: the matrices' decoupled weight decay.",
        panel=OPTIMISATION,
        allowed=NON_NEGATIVE,
    )
    schedule: str = option(
        "cosine",
        "--schedule",
        help="After the warmup: cosine (decay over all the steps), or wsd (flat, "
        "then a linear decay over the last --decay-ratio of the steps).",
        panel=OPTIMISATION,
        allowed=("cosine", "wsd"),
    )
    decay_ratio: float = option(
        0.2,
        "--decay-ratio",
        help="--schedule wsd: the decay's share of the steps.",
        panel=OPTIMISATION,
        allowed=Range(0, 1, lo_open=True),
    )
    min_lr_ratio: float = option(
        0.0,
        "--min-lr-ratio",
        help="The decay's floor as a fraction of --lr.",
        panel=OPTIMISATION,
        allowed=FRACTION,
    )
    warmup_ratio: float = option(
        0.03,
        "--warmup-ratio",
        help="Linear warmup as a fraction of the steps.",
        panel=OPTIMISATION,
        allowed=FRACTION,
    )
    weight_decay: float = option(
        0.0,
        "--weight-decay",
        help="AdamW weight decay (with --optimizer muon: the AdamW part's).",
        panel=OPTIMISATION,
        allowed=NON_NEGATIVE,
    )
    grad_clip: float = option(
        0.5,
        "--grad-clip",
        help="Clip the gradient norm to this (0: off).",
        panel=OPTIMISATION,
        allowed=NON_NEGATIVE,
    )
    grad_accum: int = option(
        1,
        "--grad-accum",
        help="Micro-batches per optimizer step (per process).",
        panel=OPTIMISATION,
        min=1,
    )
    max_steps: int | None = option(
        None,
        "--max-steps",
        help="Optimizer steps to run. Default: --epochs over the data.",
        panel=OPTIMISATION,
        min=1,
        resumable=True,
    )
    epochs: float = option(
        1.0,
        "--epochs",
        help="Passes over the training batches.",
        panel=OPTIMISATION,
        resumable=True,
        allowed=POSITIVE,
    )
    max_time: float | None = (
        option(  # seconds of the training loop; stop cleanly (checkpoint) when reached
            None,
            "--max-time",
            help="Stop cleanly (checkpoint saved) after this long, e.g. 90s, 45m, 2h (a bare "
            "number is minutes); --resume continues the schedule.",
            panel=OPTIMISATION,
            parse=parse_duration,
            resumable=True,
        )
    )
    seed: int = option(
        0, "--seed", help="Seed for init, data order and eval split.", panel=OPTIMISATION
    )


@dataclass(frozen=True)
class RuntimeOptions:
    """Where the run goes and what it runs on: output, devices, streaming, logs and checkpoints."""

    output: Path = option(
        MISSING, "--output", "-o", help="Run folder (checkpoints, logs, plot).", panel=INPUTS
    )
    prefetch: int = option(
        2,
        "--prefetch",
        help="--remote: requests in flight per client; --stream: batches the target runs "
        "ahead of the trainer; --cache: batches read ahead (0: each when needed).",
        panel=TARGET,
        min=0,
        resumable=True,
    )
    stream: bool = option(  # live target: producer threads run `prefetch` batches ahead, bounded
        False,
        "--stream",
        help="Live --target/--remote: run the target in producer threads ahead of the "
        "trainer through a bounded store (same results as without).",
        panel=TARGET,
        resumable=True,
    )
    stream_max_bytes: int | None = option(  # None: auto (spec_cli/stream/bound.py)
        None,
        "--stream-max-bytes",
        help="--stream: supervision the store may hold; producers wait beyond it. "
        "auto: --prefetch + 1 of the run's largest batches (fewer when "
        "memory, or --stream-dir's disk, has less room), or a size: 512M, "
        "4G, bytes.",
        panel=TARGET,
        parse=parse_size_or_auto,
        text="auto",
        resumable=True,
    )
    stream_dir: Path | None = option(
        None,
        "--stream-dir",
        help="--stream: keep samples as files in a folder made here (removed at the "
        "end) instead of in memory.",
        panel=TARGET,
        file_okay=False,
        resumable=True,
    )
    target_parallel: str = option(
        "auto",
        "--target-parallel",
        help="Under torchrun, a live --target: replica (whole on every rank), "
        "tensor (sharded over the machine's ranks by transformers' tensor-"
        "parallel plan: targets bigger than one GPU), or auto (tensor when "
        "its weights take over half a GPU).",
        panel=TARGET,
        resumable=True,
    )
    fsdp: bool = option(  # torchrun: shard the draft (FSDP2) instead of replicating it (DDP)
        False,
        "--fsdp",
        help="Under torchrun: shard the draft's weights, gradients and optimizer state "
        "across processes (FSDP2) instead of replicating them (DDP); for large "
        "drafts.",
        panel=RUNTIME,
        resumable=True,
    )
    context_parallel: int = option(
        1,
        "--context-parallel",
        help="Under torchrun: split each row over N ranks (context parallelism, for "
        "long rows: every rank holds 1/N of its activations); the rest of the "
        "ranks' factor is data parallel (DDP or --fsdp). EAGLE-3 and EAGLE-1/2.",
        panel=RUNTIME,
        min=1,
    )
    activation_checkpointing: bool = option(
        False,
        "--activation-checkpointing/--no-activation-checkpointing",
        help="Recompute activations in backward (long sequences). Neither given: on a GPU it turns on by "
        "itself when the largest batch would not fit without it (spec plan's measure).",
        panel=RUNTIME,
        resumable=True,
    )
    precision: str = option(
        "auto",
        "--precision",
        help="The training step: bf16 (autocast over fp32 weights), fp32, or auto: bf16 on a "
        "GPU and on a CPU that runs it natively (AMX / AVX512-BF16), else fp32. "
        "SPEC_TRAIN_PRECISION=bf16|fp32 sets what auto picks.",
        panel=RUNTIME,
        resumable=True,
    )
    attention: str = option(
        "auto",
        "--attention",
        help="The draft's TTT attention kernel: auto (the fused kernel once it passes its "
        "self-check, else the math kernel, with a warning), fused (stop rather than "
        "train without it) or math (memory O(T^2); a reference).",
        panel=RUNTIME,
        resumable=True,
    )
    device: str | None = shared(None, resumable=True)
    dtype: str | None = shared(None)  # the live target's
    target_engine: str = shared("transformers", resumable=True)  # what runs a live --target
    target_memory: float | None = shared(
        None, resumable=True
    )  # vLLM's share of the GPU (None: 0.5 here)
    target_tensor_parallel: int = shared(1, resumable=True)  # vLLM's tensor_parallel_size
    log_every: int = option(
        10, "--log-every", help="Steps per log record.", panel=CHECKPOINTS, min=1, resumable=True
    )
    eval_every: int = option(
        200,
        "--eval-every",
        help="Steps between evaluations (0: only at the end).",
        panel=CHECKPOINTS,
        min=0,
        resumable=True,
    )
    save_every: int = option(
        500,
        "--save-every",
        help="Steps between checkpoints (and at the end).",
        panel=CHECKPOINTS,
        min=1,
        resumable=True,
    )
    save_every_minutes: float | None = option(
        None,
        "--save-every-minutes",
        help="Also save a checkpoint once this many minutes have passed since "
        "the last one (what a preemption can cost is time, not steps).",
        panel=CHECKPOINTS,
        allowed=POSITIVE,
        resumable=True,
    )
    keep_last: int = option(
        3, "--keep-last", help="Checkpoints to keep.", panel=CHECKPOINTS, min=1, resumable=True
    )
    stop_grace: float = option(
        30.0,
        "--stop-grace",
        help="Seconds between a stop signal (SIGTERM, Ctrl-C) and the SIGKILL that "
        "follows it (Slurm's KillWait: 30): the step in flight finishes and the "
        "finished steps are saved if that fits in them, else the last checkpoint "
        "stands.",
        panel=CHECKPOINTS,
        allowed=POSITIVE,
        resumable=True,
    )
    resume: bool = option(
        False,
        "--resume",
        help="Continue the run in --output from its latest checkpoint.",
        panel=CHECKPOINTS,
        resumable=True,
    )
    reschedule: bool = option(
        False,
        "--reschedule",
        help="With --resume and another --max-steps or --epochs: lay the learning-rate "
        "schedule anew over the new length (the rate jumps to where the new "
        "schedule is at the resumed step). Without it such a change is refused.",
        panel=CHECKPOINTS,
        resumable=True,
    )
    eval_engine: str | None = option(
        None,
        "--eval-engine",
        help="Every --eval-engine-every steps and at the last, export the current weights "
        "through `spec export` (self-check included) and decode held-out prompts "
        "with this engine, greedy, beside the target alone, in a process of its own "
        "started once: the real acceptance length, acceptance per draft position "
        "and speed-up go into log.jsonl, the console and training.png while "
        "training goes on.",
        panel=ENGINE_LOOP,
        allowed=("vllm", "torch"),
        resumable=True,
    )
    eval_engine_every: int = option(
        200,
        "--eval-engine-every",
        help="Steps between engine evaluations (the last step is always one).",
        panel=ENGINE_LOOP,
        min=1,
        resumable=True,
    )
    eval_engine_wait: bool = option(
        False,
        "--eval-engine-wait/--no-eval-engine-wait",
        help="Wait for each engine evaluation before training "
        "on (every one is made, none skipped, at the cost "
        "of its time). Default: train while it decodes; "
        "an evaluation asked for while two are in flight "
        "is skipped (said).",
        panel=ENGINE_LOOP,
        resumable=True,
    )
    keep: str = option(
        "last",
        "--keep",
        help="best: keep the checkpoint whose engine acceptance length was the best (ties: the "
        "later step) as RUN/best, which `spec export RUN` and `spec eval RUN` then take "
        "(and say so); needs --eval-engine. last: only the checkpoints.",
        panel=ENGINE_LOOP,
        allowed=("last", "best"),
    )
    eval_prompts: str | None = option(
        None,
        "--eval-prompts",
        help="The engine's prompts: a chat data file or mt-bench (the user turns of each "
        "record; --eval-engine-prompts of them). Default: conversations of the "
        "batches held out from training (--eval-fraction), first two user turns, "
        "chosen once into RUN/engine-eval/prompts.jsonl.",
        panel=ENGINE_LOOP,
    )
    eval_engine_prompts: int = option(
        8,
        "--eval-engine-prompts",
        help="Conversations the engine decodes (both turns each).",
        panel=ENGINE_LOOP,
        min=1,
    )
    eval_engine_tokens: int = option(
        64,
        "--eval-engine-tokens",
        help="Tokens generated per turn at most.",
        panel=ENGINE_LOOP,
        min=1,
    )
    eval_engine_depth: int | None = option(
        None,
        "--eval-engine-depth",
        help="Draft tokens per target forward (a chain). Default: spec eval's, 3 "
        "(a DFlash draft: its block size - 1).",
        panel=ENGINE_LOOP,
        min=1,
    )
    eval_engine_target: str | None = option(
        None,
        "--eval-engine-target",
        help="The target the engine runs. Default: the run's --target, or the "
        "one its cache was made from (--remote: required).",
        panel=ENGINE_LOOP,
        resumable=True,
    )
    eval_engine_memory: float = option(
        0.2,
        "--eval-engine-memory",
        help="On a GPU: the share of its memory the engine process may take "
        "(vLLM's gpu_memory_utilization, split between the target-alone and "
        "the speculative engine; PyTorch's per-process fraction).",
        panel=ENGINE_LOOP,
        allowed=Range(0, 1, lo_open=True),
        resumable=True,
    )


class ObjectiveOptions:
    """TrainConfig.objective: ObjectiveFlags' options, then each registered algorithm's own
    (Algorithm.options), by name (options.ttt_steps, options.cod_ratio); what an algorithm's objective
    is built with. Frozen, compared by value."""

    def __init__(self, **values):
        declared = {name: o.default for name, o in all_options().items() if o.group == "objective"}
        unknown = sorted(set(values) - set(declared))
        if unknown:
            raise TypeError(f"ObjectiveOptions has no option {', '.join(unknown)}")
        self.__dict__.update(
            {name: values.get(name, default) for name, default in declared.items()}
        )

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectiveOptions) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash(tuple(sorted(vars(self).items())))

    def __repr__(self) -> str:
        return f"ObjectiveOptions({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


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
        """A config from flat option values (vocab_map=..., output=..., lr=3e-3); the rest default,
        to the --algorithm's own default where it has one (Algorithm.option_defaults)."""
        options = {**algorithm_defaults(options.get("algorithm")), **options}
        declared = all_options()
        unknown = sorted(set(options) - set(declared))
        if unknown:
            raise TypeError(f"TrainConfig has no option {', '.join(unknown)}")
        values: dict[str, dict] = {group: {} for group in GROUPS}
        for name, value in options.items():
            check_range(name, value, declared[name].allowed)
            values[declared[name].group][name] = value
        return cls(**{group: kind(**values[group]) for group, kind in GROUPS.items()})

    def options(self) -> dict:
        """Every option by name, flat: what run.json records."""
        return {o.name: getattr(getattr(self, o.group), o.name) for o in all_options().values()}


@dataclass(frozen=True)
class Option:
    """One `spec train` option, as the CLI and run.json see it."""

    name: str
    group: str  # the TrainConfig field that holds it
    type: object  # the field's type
    default: object  # MISSING: required
    flag: Flag | None  # None: shared with other stages, declared in spec_cli/commands/options.py
    resumable: bool
    allowed: (
        Range | tuple[str, ...] | None
    )  # a number option's range (finite), or a word option's choices


# TrainConfig's groups, by field
GROUPS: dict[str, type] = {
    "data": DataOptions,
    "draft": DraftOptions,
    "objective": ObjectiveOptions,
    "optim": OptimOptions,
    "runtime": RuntimeOptions,
}


def _declared(group: str) -> list[type]:
    """The dataclasses declaring a group's options: the objective's are ObjectiveFlags and then each
    registered algorithm's own options, in the order of spec_cli/draft/algorithms.py."""
    if group != "objective":
        return [GROUPS[group]]
    from spec_cli.draft.algorithms import ALGORITHMS

    return [ObjectiveFlags, *(a.options for a in ALGORITHMS.values() if a.options is not None)]


def all_options() -> dict[str, Option]:
    """name -> Option, in declaration order, for the algorithms registered now."""
    out: dict[str, Option] = {}
    for group in GROUPS:
        for kind in _declared(group):
            hints = typing.get_type_hints(kind)
            for f in dataclasses.fields(kind):
                if f.name in out:
                    raise TypeError(
                        f"option {f.name} is declared twice (in {out[f.name].group} and {group})"
                    )
                out[f.name] = Option(
                    f.name,
                    group,
                    hints[f.name],
                    f.default,
                    f.metadata["flag"],
                    f.metadata["resumable"],
                    f.metadata["allowed"],
                )
    return out


def algorithm_defaults(algorithm: str | None) -> dict[str, object]:
    """The defaults `algorithm` (None: the default one) sets for options every algorithm takes, where
    they differ from the declared ones (P-EAGLE's ttt_steps 7); {} for an unknown name, which
    the trainer refuses with the known ones."""
    from spec_cli.draft.algorithms import ALGORITHMS, DEFAULT

    known = ALGORITHMS.get(algorithm or DEFAULT)
    return dict(known.option_defaults) if known is not None else {}


def algorithm_defaulted() -> frozenset[str]:
    """The options some registered algorithm sets its own default for."""
    from spec_cli.draft.algorithms import ALGORITHMS

    return frozenset(name for a in ALGORITHMS.values() for name, _ in a.option_defaults)


def resumable_options() -> frozenset[str]:
    """The options that may differ on --resume (they do not change the math)."""
    return frozenset(o.name for o in all_options().values() if o.resumable)


def typed_options(ctx=None) -> set[str] | None:
    """The `spec train` options the user gave (on the command line, in the environment or in a --config
    file) rather than left at their defaults, from click's context (default: the current one); None when
    no `spec train` command is being run (then every option counts as given)."""
    if ctx is None:
        for package in (
            "typer._click.globals",
            "click.globals",
        ):  # typer >= 0.2x runs its own click
            try:
                module = __import__(package, fromlist=["get_current_context"])
            except ImportError:
                continue
            ctx = module.get_current_context(silent=True)
            if ctx is not None:
                break
    declared = all_options()
    if ctx is None or set(declared) - {p.name for p in ctx.command.params}:
        return None
    return {
        name
        for name in declared
        if (source := ctx.get_parameter_source(name)) is not None and source.name != "DEFAULT"
    }
