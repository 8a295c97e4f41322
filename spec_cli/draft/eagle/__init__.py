"""EAGLE-1/2 (Li et al. 2024): a Llama layer over cat(token embedding, the target's last feature) that
regresses the target's next feature and proposes through the target's own lm_head. EAGLE-2 is the same
draft decoded with a confidence-ranked dynamic tree (`spec eval --topk`). It reads no intermediate
layer: its supervision is the target's final hidden state (TargetBatch.final_hidden). Everything
spec_cli needs of it is the `EAGLE` value below."""

from __future__ import annotations

from spec_cli.draft import decoding
from spec_cli.draft.eagle import export
from spec_cli.draft.algorithm import Algorithm
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle.model import EagleDraft
from spec_cli.draft.eagle.objective import EagleObjective


EAGLE = Algorithm(
    name="eagle",
    aux_layers=0,
    default_aux_layers=lambda n: [],
    config=DraftConfig.from_target,  # the target's shapes (EagleDraft refuses another hidden size)
    build=EagleDraft,
    objective=EagleObjective,
    catch_up=decoding.catch_up,
    propose=decoding.propose,
    formats=export.FORMATS,
    export=export.build,
    final_hidden=True,
    title="EAGLE-1/2",
    engine_methods=(("vllm", "eagle"), ("sglang", "EAGLE")),
)
