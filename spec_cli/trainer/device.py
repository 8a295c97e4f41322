"""How this rank's training step runs on its device: the precision (--precision: autocast over the
fp32 weights), the TTT attention kernel (--attention), activation checkpointing when the step would
not fit the GPU without it, and the wiring over ranks the objective needs (--context-parallel's
split of each row, the DDP wrapper; FSDP2 itself is spec_cli/draft/sharding.py).

Each choice is made once, when the Trainer is built, and said where it differs from what the user
may expect (docs/recipe.md, "The trainer's choices", has the measurements behind them).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from spec_cli import distributed
from spec_cli.console import warn
from spec_cli.draft import attention
from spec_cli.errors import ConfigError
from spec_cli.plan.auto import needs_checkpointing
from spec_cli.targets import loading

# ----------------------------------------------------------------------------- precision


def step_precision(choice: str, device: torch.device) -> torch.dtype | None:
    """--precision: the training step's autocast dtype over the fp32 weights, None for fp32. auto:
    bf16 where the device runs it natively (a GPU; a CPU with AMX or AVX512-BF16, where the step is
    faster with the same losses: bench/precision.py), fp32 elsewhere (emulated bf16 is slower); the
    environment's SPEC_TRAIN_PRECISION, when set, is what auto picks."""
    picked = choice
    if choice == "auto":
        picked = os.environ.get("SPEC_TRAIN_PRECISION") or (
            "bf16" if loading.fast_bf16(device) else "fp32"
        )
    if picked not in ("bf16", "fp32"):
        where = "SPEC_TRAIN_PRECISION" if choice == "auto" else "--precision"
        raise ConfigError(
            f"unknown {where} {picked!r}",
            "use auto, bf16 or fp32" if choice != "auto" else "set it to bf16 or fp32, or unset it",
        )
    return torch.bfloat16 if picked == "bf16" else None


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The step's autocast: `dtype` over fp32 weights, or off (fp32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def say_precision(was: str | None, now: str, option: str, checkpoint: Path) -> None:
    """One line when a resumed checkpoint was trained in another precision (`was`) than this run's
    step (`now`): --precision auto (`option`) chooses per machine, so a run started where bf16 is
    native and resumed where it is not goes on in fp32. `was` None: a checkpoint that does not
    record it."""
    if was is None or was == now:
        return
    if option != "auto":
        why = f"--precision {option}"
    elif os.environ.get("SPEC_TRAIN_PRECISION"):
        why = f"--precision auto follows SPEC_TRAIN_PRECISION={now}"
    else:
        runs = "runs" if now == "bf16" else "does not run"
        why = f"--precision auto: this machine {runs} bf16 natively"
    warn(
        f"--resume: {Path(checkpoint).name} was trained in {was}, and this run trains in {now} "
        f"({why}); pass --precision {was} to go on in {was}"
    )


# ----------------------------------------------------------------------------- attention


def choose_attention(
    draft, impl: str, device: torch.device, autocast_dtype: torch.dtype | None, packed: bool
) -> str:
    """--attention: the TTT attention kernel for the step's activations (bf16 under CUDA's autocast,
    else the weights' fp32), self-checked before the first step; set on `draft`, and its name
    returned (with the packed rows' kernel under --pack). Says loudly when the fused kernel is not
    used where one exists: the math kernel is much slower, and its memory grows with the square of
    the row's length."""
    dtype = autocast_dtype or torch.float32  # the activations' dtype, as autocast runs the step
    kernel, why = attention.choose(device, dtype, impl)
    draft.attn_impl = impl
    if why is not None and attention.fused_kernel(device, dtype) is not None:
        warn(
            f"{why}: training uses the math attention kernel, slower and with memory O(T^2) in the row "
            "length; --attention fused stops instead"
        )
    if packed:  # documents of a packed batch: one varlen call (CUDA), or one call each
        return f"{kernel.name}, packed rows: {attention.packed_kernel_name(kernel, device, dtype)}"
    return kernel.name


# ------------------------------------------------------------------------- activation checkpointing


def largest_batch(source, cfg) -> tuple[int, int]:
    """(rows, row length) of the run's largest micro-batch by padded tokens."""
    lengths = getattr(source.tokens, "lengths", None)
    if lengths is None or not source.plan:
        return 1, cfg.data.batch_tokens
    if cfg.data.pack:  # a packed batch is one row
        shapes = [(1, int(lengths[b].sum())) for b in source.plan]
    else:
        shapes = [(len(b), int(lengths[b].max())) for b in source.plan]
    return max(shapes, key=lambda shape: shape[0] * shape[1])


def checkpointing_needed(
    cfg,
    algorithm,
    draft,
    draft_config,
    source,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> bool:
    """On a GPU: whether the step at the run's largest batch needs activation checkpointing to fit
    the GPU's free memory (spec plan's measure of the step; `needs_checkpointing`), the draft
    already on it and the engine in the loop's share kept out. The ranks agree (any rank that needs
    it)."""
    free, total = torch.cuda.mem_get_info(device)
    if cfg.runtime.eval_engine:  # the engine in the loop takes its share of this GPU (rank 0's)
        free = min(free, int((1 - cfg.runtime.eval_engine_memory) * total))
    on_device = sum(t.numel() * t.element_size() for t in [*draft.parameters(), *draft.buffers()])
    return distributed.any_rank(
        needs_checkpointing(
            algorithm,
            draft_config,
            cfg,
            largest_batch(source, cfg),
            free,
            on_device,
            autocast_dtype,
        )
    )


# ----------------------------------------------------------------------------- over ranks


def split_rows(objective, draft, source, size: int) -> None:
    """--context-parallel: the objective splits each batch's rows over a group of `size` ranks (each
    rank its zig-zag slots); a source that can, reads (or is sent) only this rank's slots of a
    row."""
    from spec_cli.draft.context import Context, kept_ranges, padded_length

    context = objective.context = Context(size, *distributed.context_group(size))
    draft.noise_offset = context.rank  # --hidden-noise: each rank its own draws for its slots
    if getattr(
        source.backend, "reads_slots", False
    ):  # a cache, or a live target run once per group:
        halo = objective.context_halo  # this rank reads, or is sent, only its slots of a row
        if hasattr(
            source.backend, "halo"
        ):  # a target run once per group: it sends every rank's slots
            source.backend.halo = halo
        source.slots_for = lambda T: (
            padded_length(T, context.size),
            kept_ranges(context.size, context.rank, padded_length(T, context.size), halo),
        )


def replicated(objective: nn.Module, device: torch.device) -> nn.Module:
    """The objective under DDP (torchrun without --fsdp): every rank starts from rank 0's weights,
    so it is made once a resume has loaded them."""
    return nn.parallel.DistributedDataParallel(
        objective, device_ids=[device.index] if device.type == "cuda" else None
    )
