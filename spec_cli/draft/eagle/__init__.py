"""EAGLE-1/2 (Li et al. 2024): a Llama layer over cat(token embedding, the target's last feature) that
regresses the target's next feature and proposes through the target's own lm_head. EAGLE-2 is the same
draft decoded with a confidence-ranked dynamic tree (`spec eval --topk`). It reads no intermediate
layer: its supervision is the target's final hidden state (TargetBatch.final_hidden). Everything
spec_cli needs of it is the `EAGLE` value below (its code: implementation.py, loaded on first use)."""

from __future__ import annotations

from dataclasses import dataclass

from spec_cli.draft.algorithm import FINAL_HIDDEN, LM_HEAD, Algorithm, ExportFormat
from spec_cli.help import OBJECTIVE
from spec_cli.options import NON_NEGATIVE, option


@dataclass(frozen=True)
class EagleOptions:
    """`spec train --algorithm eagle`'s own options (its objective: spec_cli/draft/eagle/objective.py)."""

    feature_weight: float = option(
        1.0,
        "--feature-weight",
        help="--algorithm eagle and msd: weight of SmoothL1 on the predicted next feature.",
        panel=OBJECTIVE,
        allowed=NON_NEGATIVE,
    )
    token_weight: float = option(
        0.1,
        "--token-weight",
        help="--algorithm eagle and msd: weight of soft-CE between the target's next-token "
        "distribution and the draft's (through the target's lm_head).",
        panel=OBJECTIVE,
        allowed=NON_NEGATIVE,
    )


def no_aux_layers(n: int) -> list[int]:
    return []


EAGLE = Algorithm(
    name="eagle",
    # EAGLE-3's defaults (TTT 3, lr 1e-3) are measured for EAGLE-3 only (docs/recipe.md)
    option_defaults=(("ttt_steps", 7), ("lr", 2e-4)),
    title="EAGLE-1/2",
    aux_layers=0,
    default_aux_layers=no_aux_layers,
    implementation="spec_cli.draft.eagle.implementation",
    formats=(
        ExportFormat("vllm", "vLLM", "vllm", "eagle"),
        ExportFormat("sglang", "SGLang", "sglang", "EAGLE"),
    ),
    export_rules="spec_cli.export.eagle",
    options=EagleOptions,
    needs=frozenset({FINAL_HIDDEN, LM_HEAD}),
    vllm_draft_class="vllm.model_executor.models.llama_eagle:EagleLlamaForCausalLM",
    context_parallel=True,  # --context-parallel (spec_cli/draft/context.py)
)
