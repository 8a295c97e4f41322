"""What every decoder returns for one answer: spec_cli's PyTorch loop (eval/speculative.py) and vLLM
(engine/vllm.py). Shared by eval, that vLLM serving engine and the export's engine check, so it sits
at the top of the package and imports nothing from spec_cli.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TOP_LOGITS = 8  # logits the target-alone decoder keeps per token (ties can be three-way or more)


@dataclass
class Generation:
    tokens: list[int]  # new tokens, cut at the first eos (kept) and at max_new_tokens
    seconds: float
    # per target forward of the speculative loop: (drafts accepted, deepest position verified on the
    # accepted path); the step produced accepted + 1 tokens
    steps: list[tuple[int, int]] = field(default_factory=list)
    drafts: list[list[int]] = field(
        default_factory=list
    )  # the tokens proposed at each of those forwards
    draft_seconds: float = (
        0.0  # of `seconds`, the draft's (catch-up + proposal; the PyTorch loop only)
    )
    # per forward: the draft's own P(accepted | the ones before accepted) of each verified position
    # (a draft with a confidence head: DSpark), else empty
    confidence: list[list[float]] = field(default_factory=list)
    # the target alone, greedy: per new token, its TOP_LOGITS best {id: logit}; where a speculative output
    # parts from this one, they tell a rounding tie from a real difference (report.parting)
    top: list[dict[int, float]] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return sum(m + 1 for m, _ in self.steps) / len(self.steps) if self.steps else 0.0
