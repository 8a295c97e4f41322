"""DFlash (block diffusion drafting, z-lab 2026): a small stack of Qwen3-style layers that proposes a whole
block of tokens in ONE forward. The block is [the newest verified token, mask, mask, ...]; its queries
attend, without a causal mask inside the block, to every query of the block and to keys and values
projected from the target's hidden states (five aux layers by default) at every position before it.
So the drafting cost is one forward whatever the block size. vLLM 0.32 serves it (`method: "dflash"`,
model_executor/models/qwen3_dflash.py); the speculators format calls it `dflash`. Everything spec_cli needs
of it is the `DFLASH` value below (its code: implementation.py, loaded on first use; docs/dflash.md)."""

from __future__ import annotations

from dataclasses import dataclass

from spec_cli.draft.algorithm import Algorithm, ExportFormat
from spec_cli.help import OBJECTIVE
from spec_cli.options import POSITIVE, option

AUX_LAYERS = (
    5  # target layers the context reads (the peers' Qwen3 and Llama DFlash drafts read five)
)


def default_aux_layers(n: int) -> list[int]:
    """Outputs of 0-indexed layers spread evenly from layer 1 to layer n - 3 (the peers' rule): low,
    middle and high features of a target of n decoder layers. Five distinct layers always: vLLM captures
    each layer once, so a repeated one would leave fc short of an input (small targets spread over
    layers 0 .. n - 2 instead; the engines cannot capture the last layer's output)."""
    ids = [
        round(1 + i * (n - 4) / (AUX_LAYERS - 1)) for i in range(AUX_LAYERS)
    ]  # round half to even, as they do
    if len(set(ids)) < AUX_LAYERS:
        ids = [round(i * (n - 2) / (AUX_LAYERS - 1)) for i in range(AUX_LAYERS)]
    return ids


def default_decay(block_size: int) -> float:
    """The DFlash paper's loss decay gamma for a block size (16: 7, 10: 5, 8: 4; smaller blocks 3)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0 if block_size >= 8 else 3.0


@dataclass(frozen=True)
class DFlashOptions:
    """`spec train --algorithm dflash`'s own options (its objective: spec_cli/draft/dflash/objective.py)."""

    block_size: int = option(
        8,
        "--block-size",
        help="--algorithm dflash and dspark: queries per block, the newest verified token "
        "and block_size - 1 masks; a DFlash draft proposes up to block_size - 1 "
        "tokens per forward, a DSpark draft (its anchor proposes too) block_size "
        "(vLLM: num_speculative_tokens).",
        panel=OBJECTIVE,
        min=2,
    )
    block_decay: float | None = option(
        None,
        "--block-decay",
        help="--algorithm dflash and dspark: the loss of the k-th proposed token of a "
        "block (k = 1, 2, ...) weighs exp(-(k-1)/G). Default: the DFlash paper's G "
        "for the tokens a block proposes (7: 4, 15: 7).",
        panel=OBJECTIVE,
        allowed=POSITIVE,
    )
    max_anchors: int = option(
        0,
        "--max-anchors",
        help="--algorithm dflash and dspark: blocks anchored at this many random slots of "
        "each row per step (the peers' max anchors: 512 for DFlash, 3072 for DSpark "
        "in speculators) instead of at every slot (0). Each block costs block_size "
        "queries, so this bounds a step's cost at long rows and big blocks.",
        panel=OBJECTIVE,
        min=0,
    )


DFLASH = Algorithm(
    name="dflash",
    # EAGLE-3's defaults (TTT 3, lr 1e-3) are measured for EAGLE-3 only (docs/recipe.md)
    option_defaults=(("lr", 2e-4),),
    title="DFlash",
    summary="a block of draft tokens in one non-causal forward",
    aux_layers=AUX_LAYERS,
    default_aux_layers=default_aux_layers,
    implementation="spec_cli.draft.dflash.implementation",
    formats=(
        ExportFormat("vllm", "vLLM", "vllm", "dflash"),
        ExportFormat("speculators", "vLLM (speculators format)", "vllm", "dflash"),
    ),
    export_rules="spec_cli.export.dflash",
    options=DFlashOptions,
    vllm_draft_class="vllm.model_executor.models.qwen3_dflash:DFlashQwen3ForCausalLM",
    draft_options=("block_size",),  # part of the draft's config
    steps=lambda options: options.block_size - 1,
    steps_name="block offsets",  # offsets 1 .. block_size - 1
    eval_depth=lambda config: config.extra["block_size"] - 1,  # one block forward proposes them all
)
