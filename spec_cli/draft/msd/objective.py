"""MSD's objective: EAGLE-1/2's (spec_cli/draft/eagle/objective.py: SmoothL1 on the predicted next hidden
state + soft-CE of the target's next-token distribution through its frozen language head, over the TTT
unroll), with the target's input embeddings in place of a draft embedding table: slot t reads e[t + 1],
the batch's input embeddings shifted as its token ids are (a slot with no next token reads zeros and
carries no loss)."""

from __future__ import annotations

from spec_cli.draft.algorithm import INPUT_EMBEDS
from spec_cli.draft.eagle.objective import EagleObjective, eagle_forward
from spec_cli.draft.unroll import shift_left
from spec_cli.errors import ConfigError


class MsdObjective(EagleObjective):
    def forward(self, batch, unit=None):
        embeds = batch.extras.get(INPUT_EMBEDS)
        if embeds is None:
            raise ConfigError(
                "MSD trains on the target's input embeddings and this supervision has none",
                "train from a `spec precompute --algorithm msd` cache or a live --target",
            )
        # context parallelism: the embeddings are a per-slot field like the features (whole rows, or this
        # rank's kept ranges, whose halo covers the one-slot shift and the TTT steps' reading ahead)
        batch, shard = self.context_shard(batch, halo=self.context_halo)
        return eagle_forward(
            self.draft,
            batch,
            **self.kw,
            shard=shard,
            inputs=shift_left(batch.extras[INPUT_EMBEDS], 1),
        )
