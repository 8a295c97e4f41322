"""MSD's text-to-multimodal curriculum: which source each optimizer step trains on.

    share(s) = 0                                    s < text_steps            (phase "text")
             = ratio * min(1, (s - text_steps + 1) / ramp_steps)              (phase "ramp", then "mixed")

Step s trains on an image-text batch when u(s) < share(s), with u(s) uniform in [0, 1) drawn from a
generator seeded by (seed, s) alone: no state carries from step to step, so a resumed run and every
torchrun rank (and every micro-batch of the step) make the same choice. A source's batches are taken in
the order of its own epochs (Schedule.indices): the n-th step on a source reads its n-th share of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

TEXT, MULTIMODAL = 0, 1


@dataclass
class Curriculum:
    text_steps: int
    ratio: float
    ramp_steps: int
    seed: int
    _before: list = field(default_factory=lambda: [0], repr=False)  # multimodal steps before step s

    def share(self, step: int) -> float:
        """The probability that optimizer step `step` (0-based) trains on image-text batches."""
        if step < self.text_steps:
            return 0.0
        if self.ramp_steps <= 0:
            return self.ratio
        return self.ratio * min(1.0, (step - self.text_steps + 1) / self.ramp_steps)

    def phase(self, step: int) -> str:
        if step < self.text_steps:
            return "text"
        return "ramp" if step < self.text_steps + self.ramp_steps - 1 else "mixed"

    def source(self, step: int) -> int:
        """TEXT or MULTIMODAL for optimizer step `step`, from (seed, step) alone."""
        p = self.share(step)
        if p <= 0:
            return TEXT
        draw = random.Random(self.seed * 1_000_003 + step).random()
        return MULTIMODAL if draw < p else TEXT

    def multimodal_before(self, step: int) -> int:
        """How many steps before `step` trained on image-text batches (kept as a prefix sum)."""
        while len(self._before) <= step:
            s = len(self._before) - 1
            self._before.append(self._before[-1] + self.source(s))
        return self._before[step]

    def steps_before(self, step: int, source: int) -> int:
        """How many steps before `step` drew `source`: the position of step `step` in that source's order."""
        multimodal = self.multimodal_before(step)
        return multimodal if source == MULTIMODAL else step - multimodal

    def state(self, step: int) -> dict:
        """What a checkpoint records after `step` optimizer steps (a resume checks it)."""
        return {
            "text_steps": self.text_steps,
            "multimodal_ratio": self.ratio,
            "ramp_steps": self.ramp_steps,
            "steps_on_text": self.steps_before(step, TEXT),
            "steps_on_image_text": self.steps_before(step, MULTIMODAL),
            "share": round(self.share(step), 6),
            "phase": self.phase(step),
        }

    def uses(self, total_steps: int) -> tuple[bool, bool]:
        """(any text step, any image-text step) in a run of `total_steps`."""
        multimodal = self.multimodal_before(total_steps)
        return multimodal < total_steps, multimodal > 0

    def describe(self) -> str:
        ramp = f", rising over {self.ramp_steps} steps" if self.ramp_steps > 0 else ""
        return (
            f"text batches only for {self.text_steps} steps, then image-text batches on a share of "
            f"{self.ratio:g} of the steps{ramp} (drawn per step from the seed)"
        )
