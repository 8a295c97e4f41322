"""What an algorithm's implementation module gives and takes (torch side of spec_cli/draft/algorithm.py):
the objective's base class, what an exporter reads of a checkpoint and writes, and the per-token target
fields an algorithm may ask the target backends for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from spec_cli import __version__
from spec_cli.artifacts.io import SCHEMA_VERSION
from spec_cli.draft.algorithm import INPUT_EMBEDS  # noqa: F401 (TargetField.reads' other value)
from spec_cli.draft.config import DraftConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class Objective(torch.nn.Module):
    """An algorithm's objective: forward(batch, unit=None) -> an output with `loss` (scalar) and per
    draft step `step_loss`, `correct`, `total` (sums, so they add over batches and ranks).

    `plan(batch)` lists the units one training batch runs as, each with its own forward and backward
    (the trainer calls forward(batch, unit) once per unit, through DDP, and back-propagates each); the
    units' losses add up to the batch's loss. Most objectives run a batch as one unit ([None])."""

    # context parallelism (spec_cli/draft/context.py Context), set by the trainer; an objective that
    # supports it (its algorithm declares extra["context_parallel"]) runs `context_shard(batch)`
    context = None

    def plan(self, batch) -> list:
        return [None]

    def context_shard(self, batch, halo: int = 0):
        """(the batch, as padded for context parallelism, and this rank's ContextShard), or (batch, None).
        halo: how many slots past its own the objective reads (a batch read for one rank has them)."""
        if self.context is None:
            return batch, None
        return self.context.shard(batch, halo)


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
    engine_aux_ids: list[
        int
    ]  # as written, in the engine's convention (and its concatenation order)
    aux_layer_outputs: list[int]  # the same layers in spec_cli's convention, in that order
    num_speculative_tokens: int


def provenance(src: Checkpoint, fmt: str, dtype: torch.dtype) -> dict:
    """config.json's `spec_cli` block: what spec_cli knows about an export (serving engines ignore this
    key; `spec export --overwrite`, `spec inspect` and `spec eval` read it). Every writer puts it there."""
    c = src.config
    return {
        "kind": "draft_export",
        "format": fmt,
        "algorithm": src.config.algorithm,
        "schema_version": SCHEMA_VERSION,
        "version": __version__,
        "checkpoint": str(src.checkpoint),
        "step": src.step,
        "dtype": DTYPE_NAMES[dtype],
        "aux_layer_outputs": list(c.aux_layer_ids),
        "target_num_layers": c.target_num_layers,
        "target": src.target,
        "target_architecture": c.target_architecture,
        "target_fingerprint": c.target_fingerprint,
        "tokenizer_fingerprint": c.tokenizer_fingerprint,
        "chat_template_sha256": c.chat_template_sha256,
        "chat_template_source": c.chat_template_source,
        "tokenizer_base_fingerprint": c.tokenizer_base_fingerprint,
        "rope_source": c.rope_source,
        "vocab_map_fingerprint": c.vocab_map_fingerprint,
    }


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
    # compute's first argument: the final hidden state, or INPUT_EMBEDS: what the target's first decoder
    # layer reads (the token embeddings as the model scales them, each image's features in place of its
    # placeholder tokens), captured by the in-process backends
    reads: str = "final_hidden"


# the need every backend knows: the target's final hidden state (EAGLE-1/2's feature)
FINAL_HIDDEN_FIELD = TargetField(
    "final_hidden", width=lambda hidden: hidden, compute=lambda final, aux, ids: final
)
