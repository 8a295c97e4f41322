"""MSD's code behind the `MSD` declaration (spec_cli/draft/msd/__init__.py)."""

from __future__ import annotations

import torch

from spec_cli.draft import decoding
from spec_cli.draft.algorithm import INPUT_EMBEDS
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.contract import TargetField
from spec_cli.draft.msd.model import MsdDraft
from spec_cli.draft.msd.objective import MsdObjective

config = (
    DraftConfig.from_target
)  # the target's shapes (MsdDraft, like EAGLE-1/2's, predicts its features)
build = MsdDraft
objective = MsdObjective
propose = decoding.propose  # drafted tokens are embedded by the target's module (MsdDraft.embed)

target_fields = {
    INPUT_EMBEDS: TargetField(
        INPUT_EMBEDS,
        width=lambda hidden: hidden,
        compute=lambda embeds, aux, ids: embeds,
        reads=INPUT_EMBEDS,
    )
}


def catch_up(draft, cache, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Draft slots len(cache) .. len(cache)+m-1 read (the input embeddings of ids [m], the target's features
    f): aux [m, 2H] is, per verified token x[j], cat(f[j], e[j]) (spec_cli/eval/target.py). Slot i reads
    ids[i] = x[j + 1], whose embedding is the next row's e, and for the newest token (not yet through the
    target) the target's embedding of it. Returns the last slot's state [1, 1, H]."""
    H = draft.config.target_hidden_size
    features, embeds = aux[:, :H], aux[:, H:]
    inputs = torch.cat(
        [embeds[1:].to(features.dtype), draft.embed(ids[-1:]).to(features.dtype)]
    )  # [m, H]
    start, m = len(cache), ids.numel()
    positions = torch.arange(start, start + m, device=ids.device)[None]
    return draft.forward_step(inputs[None], draft.project(features[None]), positions, cache)[:, -1:]
