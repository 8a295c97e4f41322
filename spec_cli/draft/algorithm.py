"""What a draft algorithm gives the rest of spec_cli: the one seam between the trainer, `spec eval`,
`spec export` and the algorithms (EAGLE-3 today, in `spec_cli/draft/eagle3/`).

An algorithm is a package that builds one `Algorithm` value from its own functions; `ALGORITHMS` in
`spec_cli/draft/algorithms.py` maps each name to it. The callers use nothing else of the package:

    config(target_config, draft_vocab_size, aux_layer_ids, **options) -> DraftConfig
                   the draft shaped from the target's config (the `--draft-*` options override)
    build(config) -> the draft module (an nn.Module with the decoding methods below)
    objective(draft, options: ObjectiveOptions, activation_checkpointing=False) -> Objective
                   forward(TargetBatch, unit=None) -> an output with `loss` (scalar), and per unroll step
                   `step_loss`, `correct`, `total` [ttt_steps] (sums, so they add over batches and ranks);
                   plan(batch) -> the units a training batch runs as (P-EAGLE's segments)
    catch_up(draft, cache, ids, aux) -> state      eval: read the target's true aux states
    propose(draft, cache, state, depth, topk, num_tokens, temperature, generator) -> Proposal
                   eval: the drafted tokens (a chain or a tree) from that state
    formats        the engine formats `spec export` writes for it
    export(checkpoint, fmt, dtype) -> ExportFiles  config.json + model.safetensors of one format

`aux_layers` is how many target layers the draft reads and `default_aux_layers(n)` which ones for a
target of n decoder layers (spec_cli's convention: 0-indexed layer OUTPUTS); every stage that picks or
checks aux layers (precompute, serve-target, train, eval) asks the algorithm. `final_hidden`: the
draft also reads the target's last hidden state after its final norm (EAGLE-1/2's feature), which
backends then return in TargetBatch.final_hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from spec_cli.draft.config import DraftConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class ObjectiveOptions:
    """`spec train`'s objective group: how the draft's predictions are unrolled and scored."""
    ttt_steps: int = 7  # draft steps unrolled per position (training-time test)
    step_weight: float = 0.8  # step k's loss weighs step_weight**k (normalised)
    loss: str = "soft-ce"
    lk_kl_scale: float = 1.0
    lk_kl_decay: float = 1.0
    feature_weight: float = 1.0  # EAGLE-1/2: SmoothL1 on the predicted feature
    token_weight: float = 0.1  # EAGLE-1/2: soft-CE of lm_head(predicted feature) vs the target's
    cod_ratio: float = 0.7  # P-EAGLE: depth d keeps max(cod_ratio**d, cod_min) of its valid positions
    cod_min: float = 0.2
    peagle_segments: int = 1  # P-EAGLE: forwards (each with its backward) a batch's rows are split into


class Objective(torch.nn.Module):
    """An algorithm's objective: forward(batch, unit=None) -> an output with `loss` and per-step sums.

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
class Algorithm:
    name: str  # what `spec train --algorithm` takes and config.json records
    aux_layers: int
    default_aux_layers: Callable[[int], list[int]]
    config: Callable[..., DraftConfig]
    build: Callable[[DraftConfig], torch.nn.Module]
    objective: Callable[..., torch.nn.Module]
    catch_up: Callable
    propose: Callable
    formats: tuple[str, ...]
    export: Callable[[Checkpoint, str, torch.dtype], ExportFiles] | None
    final_hidden: bool = False  # reads the target's final hidden state (TargetBatch.final_hidden)
    title: str = ""  # how people write its name ("EAGLE-3")
    engine_methods: tuple[tuple[str, str], ...] = ()  # (engine, what it calls these drafts): vLLM's
    #                       speculative_config method, SGLang's --speculative-algorithm
    vllm_options: tuple[tuple[str, object], ...] = ()  # more keys of vLLM's speculative_config
