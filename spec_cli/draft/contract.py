"""What an algorithm's implementation module gives and takes (torch side of spec_cli/draft/algorithm.py):
the objective's base class, what an exporter reads of a checkpoint and writes, and the per-token target
fields an algorithm may ask the target backends for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from spec_cli.draft.config import DraftConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class Objective(torch.nn.Module):
    """An algorithm's objective: forward(batch, unit=None) -> an output with `loss` (scalar) and per
    draft step `step_loss`, `correct`, `total` (sums, so they add over batches and ranks).

    `plan(batch)` lists the units one training batch runs as, each with its own forward and backward
    (the trainer calls forward(batch, unit) once per unit, through DDP, and back-propagates each); the
    units' losses add up to the batch's loss. Most objectives run a batch as one unit ([None])."""

    def plan(self, batch) -> list:
        return [None]


class Checkpoint(Protocol):
    """What an algorithm's exporter reads of a trained draft (export/source.py's DraftSource)."""
    checkpoint: Path
    step: int
    config: DraftConfig
    state: dict[str, torch.Tensor]
    target: str | None
    ttt_steps: int | None


@dataclass
class ExportFiles:
    format: str
    config: dict  # config.json
    tensors: dict[str, torch.Tensor]  # model.safetensors
    engine_aux_ids: list[int]  # as written, in the engine's convention (and its concatenation order)
    aux_layer_outputs: list[int]  # the same layers in spec_cli's convention, in that order
    num_speculative_tokens: int


@dataclass(frozen=True)
class TargetField:
    """A per-token field of the target an algorithm reads (TargetBatch.extras[name]), computed by every
    backend from what one target forward gives: `compute(final_hidden [B, T, H], aux [B, T, n*H],
    input_ids [B, T]) -> [B, T, width]`, position-aligned like the aux states (the final hidden state is
    the target's last layer after its final norm, in the target's dtype). A feature cache stores it
    (precompute asks the algorithm), a server sends it, streaming carries it."""
    name: str
    width: Callable[[int], int]  # the target's hidden size -> the field's last dimension
    compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# the need every backend knows: the target's final hidden state (EAGLE-1/2's feature)
FINAL_HIDDEN_FIELD = TargetField("final_hidden", width=lambda hidden: hidden,
                                 compute=lambda final, aux, ids: final)
