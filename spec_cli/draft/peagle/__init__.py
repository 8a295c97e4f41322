"""P-EAGLE (arXiv 2602.01469): an EAGLE-3 draft trained to propose all K tokens in one forward, with a
learned mask aux state and a mask token standing in for the future; vLLM serves it with
`"parallel_drafting": true` on an eagle3 speculative config (the speculators format: `peagle`), in its V1
model runner only (its formats' `runner`; which releases: spec_cli/engine/vllm_versions.py).
Everything spec_cli needs of it is the `PEAGLE` value below (its code: implementation.py, loaded on
first use); `--ttt-steps` is its number of depths K (it has no unroll: all depths run in one forward)."""

from __future__ import annotations

from dataclasses import dataclass

from spec_cli.draft.algorithm import Algorithm, ExportFormat
from spec_cli.draft.eagle3 import default_aux_layers
from spec_cli.help import OBJECTIVE
from spec_cli.options import FRACTION, option

PARALLEL = (
    ("parallel_drafting", True),
)  # vLLM's speculative_config key for all depths in one forward


@dataclass(frozen=True)
class PEagleOptions:
    """`spec train --algorithm peagle`'s own options (its objective: spec_cli/draft/peagle/objective.py)."""

    cod_ratio: float = option(
        0.7,
        "--cod-ratio",
        help="--algorithm peagle: depth d trains on max(r**d, --cod-min) of its valid "
        "positions (COD sampling); --ttt-steps is the number of depths K.",
        panel=OBJECTIVE,
        allowed=FRACTION,
    )
    cod_min: float = option(
        0.2,
        "--cod-min",
        help="--algorithm peagle: the floor of the COD share.",
        panel=OBJECTIVE,
        allowed=FRACTION,
    )
    peagle_segments: int = option(
        1,
        "--peagle-segments",
        help="--algorithm peagle: split each batch's rows into this many segments, "
        "each with its own forward and backward (less activation memory at long "
        "rows; the same loss and gradients).",
        panel=OBJECTIVE,
        min=1,
        resumable=True,
    )


PEAGLE = Algorithm(
    name="peagle",
    # EAGLE-3's defaults (TTT 3, lr 1e-3) are measured for EAGLE-3 only (docs/recipe.md)
    option_defaults=(("ttt_steps", 7), ("lr", 2e-4)),
    title="P-EAGLE",
    summary="all draft tokens in one forward",
    aux_layers=3,
    default_aux_layers=default_aux_layers,
    implementation="spec_cli.draft.peagle.implementation",
    # SGLang has no parallel drafting: it would serve the draft as an EAGLE-3 chain. vLLM serves it in its V1
    # model runner alone (0.32/0.33 config/vllm.py: V2 lists parallel drafting of EAGLE drafts as unsupported
    # and falls back to V1); 0.34 removed V1 and refuses parallel_drafting for eagle3 (config/speculative.py)
    formats=(
        ExportFormat("vllm", "vLLM", "vllm", "eagle3", PARALLEL, runner="v1"),
        ExportFormat(
            "speculators", "vLLM (speculators format)", "vllm", "eagle3", PARALLEL, runner="v1"
        ),
    ),
    export_rules="spec_cli.export.eagle3",
    options=PEagleOptions,
    vllm_draft_class="vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM",
    context_parallel=True,  # --context-parallel: each rank its anchors' rollouts (objective.py)
)
