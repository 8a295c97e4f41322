"""EAGLE-3's code behind the `EAGLE3` declaration (spec_cli/draft/eagle3/__init__.py)."""

from __future__ import annotations

from spec_cli.draft import decoding
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.contract import Objective
from spec_cli.draft.eagle3 import export as writer
from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.draft.eagle3.ttt import ttt_forward

config = DraftConfig.from_target
build = Eagle3Draft
catch_up = decoding.catch_up
propose = decoding.propose
export = writer.build


class TTTObjective(Objective):
    """The draft and its TTT loss behind one forward(batch), so DDP can wrap it."""

    def __init__(self, draft: Eagle3Draft, options, activation_checkpointing: bool = False):
        super().__init__()
        self.draft = draft
        self.kw = dict(
            ttt_steps=options.ttt_steps,
            step_weight=options.step_weight,
            loss=options.loss,
            lk_kl_scale=options.lk_kl_scale,
            lk_kl_decay=options.lk_kl_decay,
            checkpoint=activation_checkpointing,
        )
        self.context_halo = options.ttt_steps  # slots past its own a TTT step reads (t + k, k < K)

    def forward(self, batch, unit=None):
        batch, shard = self.context_shard(batch, halo=self.context_halo)
        return ttt_forward(self.draft, batch, **self.kw, shard=shard)


objective = TTTObjective
