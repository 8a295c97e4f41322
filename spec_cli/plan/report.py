"""`spec plan`: what a draft run for a target will need, before renting the GPUs.

Measured (spec_cli/plan/step.py): the draft's parameters, its training step's FLOPs and peak memory
per GPU at each sequence length, with and without activation checkpointing, from the real step run on
fake tensors. Counted exactly: the target's parameters (its model built on the meta device), the
feature cache's bytes per token (the cache writer's own formula). Estimated, and said so: the GPU
hours (FLOPs over the GPUs' peak at a stated utilisation), the live target's forward at training
(its weights exactly, its largest activations by formula), and a margin for what the step cannot see
(CUDA context, allocator fragmentation).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spec_cli.errors import ConfigError

# bf16 dense tensor-core peak (TFLOP/s, no sparsity) and memory (GB, 10^9 bytes), from the vendors'
# datasheets; --gpu-memory / --gpu-tflops override them
GPUS = {
    "a100-40gb": (40, 312),
    "a100": (80, 312),
    "l40s": (48, 362),
    "h100": (80, 989),
    "h200": (141, 989),
    "b200": (180, 2250),
    "mi300x": (192, 1307),
}
CONTEXT_BYTES = 1.0e9  # the CUDA context, cuBLAS workspaces and NCCL buffers, per process
FRAGMENTATION = 0.05  # the caching allocator's rounding and fragmentation, on top of the peak


@dataclass
class PlanSettings:
    target: Path
    algorithm: str = "eagle3"
    seq_lens: tuple[int, ...] = (8192, 32768)
    batch_size: int = 1
    draft_vocab_size: int = 32000
    ttt_steps: int | None = None  # None: the algorithm's (spec train's default)
    draft_layers: int = 1
    block_size: int = 8  # DFlash and DSpark: queries per block
    max_anchors: int = 0  # DFlash and DSpark: blocks at this many slots a row (0: every slot)
    markov_rank: int = 256  # DSpark
    samples: int = 100_000
    avg_tokens: int = 1024
    epochs: float = 1.0
    gpus: int = 8
    gpu: str = "h100"
    gpu_memory: float | None = None  # GB
    gpu_tflops: float | None = None
    utilization: float = 0.35
    precision: str = "bf16"  # bf16: a CUDA run (bf16 autocast, bf16 target); fp32: a CPU run
    target_engine: str = "transformers"  # what runs a live target (spec train --target-engine)
    context_parallel: int = 1  # > 1: also each step with rows split over this many ranks

    @property
    def tokens(self) -> int:
        return self.samples * self.avg_tokens


@dataclass
class StepRow:
    seq_len: int
    activation_checkpointing: bool
    peak_gb: float  # the step's peak (weights, AdamW state, batch included)
    need_gb: float  # peak + fragmentation + the CUDA context: what the GPU must have
    need_live_gb: float  # need_gb + the live target's share on this GPU (weights, forward)
    peak_live_gb: (
        float  # peak_gb + the live target's share (no margins: an allocator's peak compares to it)
    )
    flops_per_token: float
    fits: bool  # from the cache
    fits_live: bool  # with the live target on the same GPU
    context_parallel: int = (
        1  # ranks each row is split over (the row is per rank; FLOPs per rank's token)
    )


@dataclass
class Plan:
    settings: dict
    target: dict
    draft: dict
    steps: list[StepRow]
    cache: list[dict]
    hours: dict
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def read_target_config(path: Path):
    """A transformers config from a model folder or a config.json file."""
    from spec_cli.targets.loading import config_from_dict

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no config.json at {path}", "pass a model folder or its config.json")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{file} is not readable JSON ({exc})", "pass the target's config.json"
        ) from exc
    return config_from_dict(data)


def _text(config):
    return (
        config.text_config
        if getattr(config, "num_hidden_layers", None) is None
        and getattr(config, "text_config", None) is not None
        else config
    )


def target_count(config):
    """The target's parameters, total and active per token, and its stored weights (plan/target.py):
    its transformers model built on the meta device (no memory), or a decoder by formula."""
    import torch
    from transformers import AutoModelForCausalLM

    from spec_cli.plan.target import count

    def build():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    return count(config, _text(config), build)


def make_plan(s: PlanSettings) -> Plan:
    import torch

    from spec_cli.artifacts import feature_cache as fc
    from spec_cli.console import warn
    from spec_cli.draft import algorithms
    from spec_cli.draft.algorithm import LM_HEAD
    from spec_cli.plan.step import measure_step
    from spec_cli.plan.target import plan_assumption
    from spec_cli.targets.supervision import LOGITS_CHUNK_BYTES
    from spec_cli.train_options import ObjectiveOptions, algorithm_defaults

    if s.gpu not in GPUS and (s.gpu_memory is None or s.gpu_tflops is None):
        raise ConfigError(
            f"unknown --gpu {s.gpu!r}",
            f"use one of {', '.join(GPUS)}, or give --gpu-memory and --gpu-tflops",
        )
    if not 0 < s.utilization <= 1:
        raise ConfigError(
            f"--utilization {s.utilization} is not a fraction", "e.g. --utilization 0.35"
        )
    if s.gpus < 1 or s.batch_size < 1 or min(s.seq_lens) < 2:
        raise ConfigError("--gpus, --batch-size must be at least 1 and --seq-len at least 2", "")
    memory_gb, tflops = GPUS.get(s.gpu, (None, None))
    memory_gb, tflops = s.gpu_memory or memory_gb, s.gpu_tflops or tflops
    algorithm = algorithms.get(s.algorithm)
    config = read_target_config(s.target)
    text = _text(config)
    assumed = plan_assumption(text)
    if assumed is not None:
        warn(assumed)
    L, H, V = text.num_hidden_layers, text.hidden_size, text.vocab_size
    vd = V if LM_HEAD in algorithm.needs else min(s.draft_vocab_size, V)
    blocks = {
        k: v
        for k, v in (("block_size", s.block_size), ("markov_rank", s.markov_rank))
        if k in algorithm.draft_options
    }
    draft_config = algorithm.config(
        config, vd, algorithm.default_aux_layers(L), num_hidden_layers=s.draft_layers, **blocks
    )
    ttt_steps = (  # None: spec train's default for the algorithm
        algorithm_defaults(algorithm.name).get("ttt_steps", ObjectiveOptions().ttt_steps)
        if s.ttt_steps is None
        else s.ttt_steps
    )
    options = ObjectiveOptions(
        ttt_steps=ttt_steps,
        block_size=s.block_size,
        max_anchors=s.max_anchors,
        markov_rank=s.markov_rank,
    )
    if s.precision not in ("bf16", "fp32"):
        raise ConfigError(
            f"unknown --precision {s.precision!r}", "use bf16 (a GPU run) or fp32 (a CPU run)"
        )
    half = s.precision == "bf16"
    if s.target_engine not in ("transformers", "vllm"):
        raise ConfigError(
            f"unknown --target-engine {s.target_engine!r}", "use transformers or vllm"
        )
    counted = target_count(config)
    n_target = counted.total
    target_bytes = counted.engine_bytes(s.target_engine) if half else n_target * 4
    gpu_bytes = memory_gb * 1e9
    replica = target_bytes + CONTEXT_BYTES < 0.6 * gpu_bytes  # room left for the draft's step
    sharded = target_bytes / min(s.gpus, 8)  # tensor parallel over the node's GPUs
    per_gpu_target = target_bytes if replica else sharded

    if s.context_parallel < 1 or (s.context_parallel > 1 and s.gpus % s.context_parallel):
        raise ConfigError(
            f"--context-parallel {s.context_parallel} does not divide --gpus {s.gpus}",
            "choose a divisor of the GPUs",
        )
    rows, trained, frozen = [], 0, 0
    for T, ckpt, cp in (
        (T, ckpt, cp)
        for T in s.seq_lens
        for cp in sorted({1, s.context_parallel})
        for ckpt in (False, True)
    ):
        m = measure_step(
            algorithm,
            draft_config,
            options,
            T,
            batch=s.batch_size,
            activation_checkpointing=ckpt,
            autocast_dtype=torch.bfloat16 if half else None,
            target_dtype=torch.bfloat16 if half else torch.float32,
            context=cp,
        )
        trained, frozen = m.trained, m.frozen
        need = m.peak * (1 + FRAGMENTATION) + CONTEXT_BYTES
        # the live target's forward at training, by formula (spec_cli/targets/hf_backend.py): the hidden
        # states it keeps (the aux layers and the last), one MLP's [T, 2 x intermediate] at a time, the
        # draft-vocab logits and distribution [T, Vd] in fp32, and the full vocab scanned a chunk of tokens
        # at a time (never [T, V]); its weights exactly. Added to the step's peak: an upper bound (its
        # transients are gone before the step runs)
        width = 2 if half else 4
        forward = (
            s.batch_size
            * T
            * (
                2 * vd * 4
                + (len(draft_config.aux_layer_ids) + 2) * H * width
                + 2 * counted.mlp_width * width
            )
            + 3 * LOGITS_CHUNK_BYTES
        )
        need_live = need + per_gpu_target + forward
        rows.append(
            StepRow(
                T,
                ckpt,
                m.peak / 1e9,
                need / 1e9,
                need_live / 1e9,
                (m.peak + per_gpu_target + forward) / 1e9,
                m.flops * cp / (s.batch_size * T),
                need <= gpu_bytes,
                need_live <= gpu_bytes,
                cp,
            )
        )

    cache = []
    for encoding in fc.ENCODINGS:
        for dtype, name in (("bf16", "bfloat16"), ("fp32", "float32")):
            per = fc.bytes_per_token(encoding, H, vd, name, len(draft_config.aux_layer_ids))
            cache.append(
                {
                    "encoding": encoding,
                    "storage_dtype": dtype,
                    "bytes_per_token": per,
                    "total_gb": per * s.tokens / 1e9,
                }
            )

    # GPU hours: FLOPs over peak x utilisation. Precompute runs the target's forward once per token
    # (2 FLOPs per parameter the token runs through: an MoE's active ones, not the embedding's lookup;
    # and causal attention at the mean length); training the draft's step.
    rate = s.gpus * tflops * 1e12 * s.utilization
    attention = 2 * L * H * s.avg_tokens  # causal: 4 * L * (T / 2) * H per token
    precompute_flops = s.tokens * (2 * (counted.active - counted.embedding) + attention)
    at_mean = measure_step(
        algorithm,
        draft_config,
        options,
        s.avg_tokens,
        batch=s.batch_size,
        autocast_dtype=torch.bfloat16 if half else None,
        target_dtype=torch.bfloat16 if half else torch.float32,
    )
    train_flops = s.tokens * s.epochs * at_mean.flops / (s.batch_size * s.avg_tokens)
    hours = {
        "gpus": s.gpus,
        "gpu": s.gpu,
        "gpu_memory_gb": memory_gb,
        "gpu_tflops": tflops,
        "utilization": s.utilization,
        "tokens": s.tokens,
        "precompute_hours": precompute_flops / rate / 3600,
        "train_hours": train_flops / rate / 3600,
        "train_flops_per_token": at_mean.flops / (s.batch_size * s.avg_tokens),
    }
    kept = "in fp32" if not half else _kept(counted, s.target_engine)
    notes = [
        f"the target ({n_target / 1e9:.2f} B parameters, {target_bytes / 1e9:.1f} GB {kept}) "
        + (
            "fits one GPU: with a live target each rank holds a replica"
            if replica
            else f"does not fit one GPU with room for the draft: a live target is sharded "
            f"over the node's GPUs (--target-parallel tensor, {per_gpu_target / 1e9:.1f} GB each), "
            "or precompute a cache"
        )
    ]
    notes += _moe_notes(counted, config, draft_config, s)
    if s.context_parallel > 1:
        notes.append(
            f"with --context-parallel {s.context_parallel} each rank holds 1/{s.context_parallel} of a "
            "row's activations and all-gathers the step-0 keys and values (its step's peak above); from "
            "a feature cache it reads only its slots of the rows (counted so); a live target runs once "
            "per group, on its first rank: 'needs (live target)' is that rank's (the target's weights "
            "and its forward over the whole rows), the group's other ranks hold none of it and need "
            "what a cache run needs"
        )
    for r in rows:
        if not r.fits and not r.activation_checkpointing:
            other = next(
                o
                for o in rows
                if o.seq_len == r.seq_len
                and o.activation_checkpointing
                and o.context_parallel == r.context_parallel
            )
            notes.append(
                f"T = {r.seq_len}: {r.need_gb:.0f} GB does not fit {memory_gb:g} GB; "
                + (
                    f"--activation-checkpointing brings it to {other.need_gb:.0f} GB"
                    if other.fits
                    else f"not even with --activation-checkpointing ({other.need_gb:.0f} GB): "
                    "shorter rows or context parallelism"
                )
            )
    return Plan(
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
        target={
            "architecture": (getattr(config, "architectures", None) or [""])[0],
            "parameters": n_target,
            "active_parameters": counted.active,
            "experts": counted.experts,
            "experts_per_token": counted.experts_per_token,
            "moe_layers": counted.moe_layers,
            "expert_parameters": counted.expert_parameters,
            "layers": L,
            "hidden_size": H,
            "vocab_size": V,
            "engine": s.target_engine,
            "quantization": counted.quantization,
            "stored_gb": counted.stored_bytes() / 1e9,
            "bf16_gb": counted.bf16_bytes() / 1e9,
            "weights_gb": target_bytes / 1e9,
            "replica_gb": target_bytes / 1e9,
            "sharded_gb": sharded / 1e9,
            "sharded_over": min(s.gpus, 8),
            "per_gpu_gb": per_gpu_target / 1e9,
            "placement": "replica" if replica else "tensor-parallel",
        },
        draft={
            "algorithm": algorithm.name,
            "trained_parameters": trained,
            "frozen_parameters": frozen,
            "draft_vocab_size": vd,
            "aux_layers": list(draft_config.aux_layer_ids),
            "layers": s.draft_layers,
            "ttt_steps": ttt_steps,
            "steps": (
                f"{algorithm.steps_name} {algorithm.steps(options)}"
                if algorithm.steps
                else f"TTT {ttt_steps}"
            ),
        },
        steps=rows,
        cache=cache,
        hours=hours,
        notes=notes,
    )


def _kept(counted, engine: str) -> str:
    """How a live target of `engine` keeps the weights, in words."""
    if counted.quantization is None:
        return "in bf16"
    if engine == "vllm" and counted.stored_bytes() != counted.bf16_bytes():
        return f"as stored, {counted.quantization} (vLLM keeps it)"
    return f"in bf16 (transformers dequantizes {counted.quantization} without its GPU kernels: an upper bound)"


def _moe_notes(counted, config, draft_config, s: PlanSettings) -> list[str]:
    notes = []
    if counted.quantization is not None:
        stored = counted.stored_bytes()
        if stored == counted.bf16_bytes():
            notes.append(
                f"the checkpoint is quantized ({counted.quantization}), a method the plan does not "
                "size: its weights are counted at bf16"
            )
        else:
            notes.append(
                f"the checkpoint stores {counted.quantized_parameters / 1e9:.1f} B parameters in "
                f"{counted.quantization}: {stored / 1e9:.1f} GB as stored (what --target-engine vllm "
                f"keeps), {counted.bf16_bytes() / 1e9:.1f} GB in bf16 (transformers, without its "
                f"{counted.quantization} kernels)"
            )
    if counted.moe:
        text = _text(config)
        expert = getattr(text, "moe_intermediate_size", None)
        dense = getattr(text, "intermediate_size", None)
        notes.append(
            f"mixture of experts: {counted.experts} routed experts, {counted.experts_per_token} per token, "
            f"in {counted.moe_layers} of {text.num_hidden_layers} layers: {counted.active / 1e9:.2f} B of "
            f"{counted.total / 1e9:.2f} B parameters active per token, so precompute's FLOPs count "
            "the active ones and its memory all of them"
        )
        notes.append(
            f"the draft's MLP is dense, intermediate size {draft_config.intermediate_size}: the target's "
            "`intermediate_size` field, as speculators and SpecForge's config generator take it"
            + (
                f" (here the dense MLP's width; one expert's is {expert}, and {counted.experts_per_token} "
                f"experts give a token {counted.experts_per_token * expert})"
                if expert and expert != dense
                else " (here one expert's width)"
            )
            + "; --draft-intermediate-size sets another (docs/moe.md)"
        )
    return notes


def show(plan: Plan) -> None:
    from rich.table import Table

    from spec_cli.console import console, human_bytes

    t, d, h = plan.target, plan.draft, plan.hours
    active = (
        f" ({t['active_parameters'] / 1e9:.2f} B active: {t['experts_per_token']} of {t['experts']} experts)"
        if t.get("experts")
        else ""
    )
    stored = (
        f", {t['stored_gb']:.1f} GB as stored ({t['quantization']})"
        if t.get("quantization")
        else ""
    )
    console.print(
        f"[bold]target[/] {t['architecture']}: {t['parameters'] / 1e9:.2f} B parameters{active}, "
        f"{t['layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']}{stored}; a live "
        f"{t['engine']} target keeps {t['weights_gb']:.1f} GB: a replica per GPU, or "
        f"{t['sharded_gb']:.1f} GB per GPU sharded over {t['sharded_over']} ({t['placement']} here)"
    )
    console.print(
        f"[bold]draft[/] {d['algorithm']}: {d['trained_parameters'] / 1e6:.0f} M trained + "
        f"{d['frozen_parameters'] / 1e6:.0f} M frozen parameters, {d['layers']} layer(s), "
        f"draft vocab {d['draft_vocab_size']}, aux layers {d['aux_layers']}, {d.get('steps', 'TTT ' + str(d['ttt_steps']))}"
    )
    table = Table(
        title=f"one training step per GPU (batch {plan.settings['batch_size']}), bf16 autocast, "
        f"on a {h['gpu_memory_gb']:g} GB GPU"
    )
    context = any(r.context_parallel > 1 for r in plan.steps)
    for name in (
        "T",
        *(("context parallel",) if context else ()),
        "act. ckpt",
        "step peak",
        "needs (cache)",
        "fits",
        "needs (live target)",
        "fits",
        "GFLOP/token",
    ):
        table.add_column(name, justify="right")
    for r in plan.steps:
        table.add_row(
            str(r.seq_len),
            *((str(r.context_parallel),) if context else ()),
            "on" if r.activation_checkpointing else "off",
            f"{r.peak_gb:.1f} GB",
            f"{r.need_gb:.1f} GB",
            "yes" if r.fits else "[red]no[/]",
            f"{r.need_live_gb:.1f} GB",
            "yes" if r.fits_live else "[red]no[/]",
            f"{r.flops_per_token / 1e9:.1f}",
        )
    console.print(table)
    cache = Table(title=f"feature cache for {h['tokens'] / 1e6:.0f} M tokens")
    for name in ("encoding", "storage dtype", "bytes/token", "disk"):
        cache.add_column(name, justify="right")
    for c in plan.cache:
        cache.add_row(
            c["encoding"],
            c["storage_dtype"],
            f"{c['bytes_per_token']:,}",
            human_bytes(c["total_gb"] * 1e9),
        )
    console.print(cache)
    console.print(
        f"[bold]time[/] on {h['gpus']} x {h['gpu']} at {h['utilization']:.0%} of "
        f"{h['gpu_tflops']:g} TFLOP/s: precompute {_hours(h['precompute_hours'])}, training "
        f"{_hours(h['train_hours'])} ({plan.settings['epochs']:g} epoch(s) of rows of "
        f"{plan.settings['avg_tokens']} tokens: {h['train_flops_per_token'] / 1e9:.1f} GFLOP/token)"
    )
    for note in plan.notes:
        console.print(f"- {note}")


def _hours(x: float) -> str:
    return f"{x * 60:.0f} min" if x < 1 else f"{x:.1f} h" if x < 100 else f"{math.ceil(x)} h"
