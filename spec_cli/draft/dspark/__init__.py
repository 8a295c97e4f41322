"""DSpark (semi-autoregressive block drafting): a DFlash drafter (spec_cli/draft/dflash/: the context keys
and values from five aux layers, one non-causal forward over the block) with two small heads.

- Markov head: a low-rank transition bias. markov_w1 [V, r] embeds the previous token (target vocab),
  markov_w2 [Vd, r] maps it to draft-vocab logits; position i's logits are the block forward's plus
  w2 @ w1[the token before it], sampled left to right, so the block's tokens depend on each other for the
  cost of r x Vd per position.
- Confidence head: a linear map of [the position's final state, w1[the token before it]] to the probability
  that the position is accepted given that the ones before it were; vLLM uses it to size verification.

The block samples from its anchor (vLLM's `sample_from_anchor`): [the newest verified token, noise x
(B - 1)] proposes B tokens, query i the token after it. vLLM 0.32 serves it as `method: "dspark"`
(model_executor/models/qwen3_dspark.py, v1/worker/gpu/spec_decode/dspark/) in its V2 model runner only.
Everything spec_cli needs of it is the `DSPARK` value below (its code: implementation.py; docs/dspark.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from spec_cli.draft.algorithm import Algorithm, ExportFormat
from spec_cli.draft.dflash import AUX_LAYERS, default_aux_layers, default_decay
from spec_cli.help import OBJECTIVE
from spec_cli.options import NON_NEGATIVE, option

# the public recipe's loss weights (the DSpark paper's; NeMo AutoModel's and Megatron-Bridge's defaults)
CE_WEIGHT, L1_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0
MARKOV_RANK = 256  # speculators' default rank


def decay(block_size: int) -> float:
    """The default loss decay G for a DSpark block of B queries: DFlash's for the block that proposes as
    many tokens (B + 1 with its anchor), so blocks of 7 and 8 weigh their positions alike in both."""
    return default_decay(block_size + 1)


@dataclass(frozen=True)
class DSparkOptions:
    """`spec train --algorithm dspark`'s own options; --block-size, --block-decay and --max-anchors are
    DFlash's (a DSpark block of B queries proposes B tokens). Its objective: objective.py."""

    markov_rank: int = option(
        MARKOV_RANK,
        "--markov-rank",
        help="--algorithm dspark: the rank r of the Markov head (markov_w1 "
        "[target vocab, r], markov_w2 [draft vocab, r]).",
        panel=OBJECTIVE,
        min=1,
    )
    confidence_head: bool = option(
        True,
        "--confidence-head/--no-confidence-head",
        help="--algorithm dspark: train the confidence head (per-position acceptance probability; vLLM's "
        "adaptive verification reads it).",
        panel=OBJECTIVE,
    )
    confidence_with_markov: bool = option(
        True,
        "--confidence-with-markov/--confidence-without-markov",
        help="--algorithm dspark: the confidence head reads the Markov embedding of the previous token "
        "beside the position's state.",
        panel=OBJECTIVE,
    )
    ce_weight: float = option(
        CE_WEIGHT,
        "--ce-weight",
        help="--algorithm dspark: weight of the hard cross-entropy against the "
        "target's top-1 token.",
        panel=OBJECTIVE,
        allowed=NON_NEGATIVE,
    )
    l1_weight: float = option(
        L1_WEIGHT,
        "--l1-weight",
        help="--algorithm dspark: weight of the L1 distance between the draft's "
        "and the target's next-token distributions (2 x total variation).",
        panel=OBJECTIVE,
        allowed=NON_NEGATIVE,
    )
    confidence_weight: float = option(
        CONFIDENCE_WEIGHT,
        "--confidence-weight",
        help="--algorithm dspark: weight of the confidence head's binary cross-entropy against each "
        "position's acceptance probability.",
        panel=OBJECTIVE,
        allowed=NON_NEGATIVE,
    )


DSPARK = Algorithm(
    name="dspark",
    # EAGLE-3's defaults (TTT 3, lr 1e-3) are measured for EAGLE-3 only (docs/recipe.md)
    option_defaults=(("lr", 2e-4),),
    title="DSpark",
    summary="a DFlash block with a Markov head and a confidence head",
    aux_layers=AUX_LAYERS,
    default_aux_layers=default_aux_layers,
    implementation="spec_cli.draft.dspark.implementation",
    formats=(
        ExportFormat(
            "vllm", "vLLM", "vllm", "dspark", runner="v2"
        ),  # (vllm/config/vllm.py: V1 refuses it)
        ExportFormat("speculators", "vLLM (speculators format)", "vllm", "dspark", runner="v2"),
    ),
    export_rules="spec_cli.export.dspark",
    options=DSparkOptions,
    vllm_draft_class="vllm.model_executor.models.qwen3_dspark:Qwen3DSparkForCausalLM",
    draft_options=("block_size", "markov_rank", "confidence_head", "confidence_with_markov"),
    steps=lambda options: options.block_size,
    steps_name="block positions",  # queries 0 .. B - 1
    eval_depth=lambda config: config.extra["block_size"],  # one block forward proposes B tokens
)
