"""When `spec train` on a GPU turns activation checkpointing on by itself: the step `spec plan` measures
(plan/step.py) against the GPU's free memory."""

from __future__ import annotations

import torch

from spec_cli.console import info, warn
from spec_cli.draft.algorithm import Algorithm
from spec_cli.plan.report import FRAGMENTATION
from spec_cli.plan.step import measure_step, plannable


def needs_checkpointing(
    algorithm: Algorithm,
    draft_config,
    cfg,
    shape: tuple[int, int],
    free_bytes: int,
    on_device: int,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
) -> bool:
    """Whether the step at `shape` (rows, length) needs activation checkpointing to fit `free_bytes` of
    the GPU, `on_device` bytes of it (the draft's weights) already there: `spec plan`'s measure of the
    step without it, with its fragmentation margin. Says what it chose and why, and warns when even
    checkpointing will not fit. autocast_dtype: the step's (--precision; None: fp32)."""
    if plannable(algorithm) is not None:
        return False  # no plan (P-EAGLE): as asked
    rows, length = shape

    def need(checkpointing: bool) -> float:
        m = measure_step(
            algorithm,
            draft_config,
            cfg.objective,
            length,
            batch=rows,
            activation_checkpointing=checkpointing,
            optim=cfg.optim,
            grad_clip=cfg.optim.grad_clip,
            autocast_dtype=autocast_dtype,
        )
        return m.peak * (1 + FRAGMENTATION) - on_device

    without = need(False)
    if without <= free_bytes:
        return False
    with_it = need(True)
    gb = 1e9
    info(
        f"activation checkpointing on: the largest batch ({rows} x {length} tokens) needs "
        f"{without / gb:.1f} GB without it and {with_it / gb:.1f} GB with it; {free_bytes / gb:.1f} GB of the GPU "
        "are free (spec plan's measure; --no-activation-checkpointing keeps it off)"
    )
    if with_it > free_bytes:
        warn(
            f"the largest batch ({rows} x {length} tokens) needs {with_it / gb:.1f} GB even with activation "
            f"checkpointing and {free_bytes / gb:.1f} GB are free: expect an out-of-memory error; use a "
            "smaller --batch-tokens / --max-length (spec plan shows what fits)"
        )
    return True
