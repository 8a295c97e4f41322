"""EAGLE-3 (Li et al. 2025): one Llama-style layer over [token embedding, fc(three target aux states)],
trained with the training-time-test unroll, served by vLLM (`eagle3`), SGLang (`EAGLE3`) and the
speculators format. Everything spec_cli needs of it is the `EAGLE3` value below (its code:
implementation.py, loaded on first use)."""

from __future__ import annotations

from spec_cli.draft.algorithm import Algorithm, ExportFormat


def default_aux_layers(n: int) -> list[int]:
    """Outputs of 0-indexed layers 1, N//2-1, N-4 (= inputs of layers 2, N//2, N-3): low, middle and
    high features, the layers vLLM and SGLang capture by default. Three distinct layers always: vLLM
    captures each layer once (interfaces.py: sorted(set(layers))), so on a target where the rule repeats
    one (N = 5, 6) fc would be short of an input; such targets spread three over layers 1 .. N - 2
    (0 .. N - 2 when that is too few)."""
    ids = [1, n // 2 - 1, n - 4]
    if len(set(ids)) < 3 or min(ids) < 0:
        lo = 1 if n - 2 >= 3 else 0
        ids = sorted({round(lo + i * (n - 2 - lo) / 2) for i in range(3)})
    return ids


EAGLE3 = Algorithm(
    name="eagle3",
    title="EAGLE-3",
    aux_layers=3,
    default_aux_layers=default_aux_layers,
    implementation="spec_cli.draft.eagle3.implementation",
    formats=(
        ExportFormat("vllm", "vLLM", "vllm", "eagle3"),
        ExportFormat("sglang", "SGLang", "sglang", "EAGLE3"),
        ExportFormat("speculators", "vLLM (speculators format)", "vllm", "eagle3"),
    ),
    export_rules="spec_cli.export.eagle3",
    vllm_draft_class="vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM",
    # --draft-window (sliding-window attention) and --context-parallel (spec_cli/draft/context.py)
    sliding_window=True,
    context_parallel=True,
)
