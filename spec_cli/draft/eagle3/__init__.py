"""EAGLE-3 (Li et al. 2025): one Llama-style layer over [token embedding, fc(three target aux states)],
trained with the training-time-test unroll, served by vLLM (`eagle3`), SGLang (`EAGLE3`) and the
speculators format. Everything spec_cli needs of it is the `EAGLE3` value below."""

from __future__ import annotations


from spec_cli.draft import decoding
from spec_cli.draft.algorithm import Algorithm, Objective, ObjectiveOptions
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle3 import export
from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.draft.eagle3.ttt import ttt_forward


def default_aux_layers(n: int) -> list[int]:
    """Outputs of 0-indexed layers 1, N//2-1, N-4 (= inputs of layers 2, N//2, N-3): low, middle and
    high features, the layers vLLM and SGLang capture by default."""
    return [1, n // 2 - 1, n - 4]


class TTTObjective(Objective):
    """The draft and its TTT loss behind one forward(batch), so DDP can wrap it."""

    def __init__(self, draft: Eagle3Draft, options: ObjectiveOptions, activation_checkpointing: bool = False):
        super().__init__()
        self.draft = draft
        self.kw = dict(ttt_steps=options.ttt_steps, step_weight=options.step_weight, loss=options.loss,
                       lk_kl_scale=options.lk_kl_scale, lk_kl_decay=options.lk_kl_decay,
                       checkpoint=activation_checkpointing)

    def forward(self, batch, unit=None):
        return ttt_forward(self.draft, batch, **self.kw)


EAGLE3 = Algorithm(
    name="eagle3",
    aux_layers=3,
    default_aux_layers=default_aux_layers,
    config=DraftConfig.from_target,
    build=Eagle3Draft,
    objective=TTTObjective,
    catch_up=decoding.catch_up,
    propose=decoding.propose,
    formats=export.FORMATS,
    export=export.build,
    title="EAGLE-3",
    engine_methods=(("vllm", "eagle3"), ("sglang", "EAGLE3")),
)
