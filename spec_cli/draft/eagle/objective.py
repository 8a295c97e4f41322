"""EAGLE-1/2's objective: the shared TTT unroll (spec_cli/draft/unroll.py; one step is the original
EAGLE-1 training step, more feed the draft its own predicted features as at serving), scored at each
step on

    feature_weight * SmoothL1(predicted feature, the target's next feature)   (mean over H, then tokens)
  + token_weight * soft-CE(the target's next-token distribution, lm_head(predicted feature))

(weights 1.0 and 0.1 in EAGLE-1's train/main.py). Slot t at step k predicts f[t + k + 1], whose lm_head
distribution is the target's for token t + k + 2, i.e. target_p[t + k] of the shifted batch. Top-1:
the argmax of the draft's logits equals the target's. Every loss_mask position is supervised (the
vocabulary is the target's, so no token is out of reach).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from spec_cli.batch import TargetBatch
from spec_cli.draft.contract import Objective
from spec_cli.draft.losses import chunked_soft_ce, soft_cross_entropy
from spec_cli.draft.unroll import ObjectiveOutput, unroll
from spec_cli.errors import ConfigError


def feature_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """SmoothL1 (beta 1) between [N, H] features: mean over H, then over the N positions (0 when N = 0)."""
    per_token = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)
    return per_token.sum() / max(per_token.numel(), 1)


def _head(
    draft,
    state,
    batch: TargetBatch,
    b,
    t,
    k: int,
    g=None,
    *,
    feature_weight: float,
    token_weight: float,
):
    """Step k at the slots (b, t) of `state`, which sit at g in the batch's rows (t unless under context
    parallelism)."""
    g = t if g is None else g
    predicted = state[b, t]  # [N, H]
    logits = draft.logits(predicted)  # [N, V]
    value = feature_weight * feature_loss(
        predicted, batch.final_hidden[b, g + k + 1]
    ) + token_weight * soft_cross_entropy(logits, batch.target_p[b, g + k])
    return value, (logits.detach().argmax(-1) == batch.target_ids[b, g + k]).sum()


def _feature_part(state, final_hidden, b, t, g, k: int) -> torch.Tensor:
    return feature_loss(state[b, t], final_hidden[b, g + k + 1])


def _chunked_head(
    draft,
    state,
    batch: TargetBatch,
    b,
    t,
    k: int,
    g=None,
    *,
    feature_weight: float,
    token_weight: float,
):
    """_head for long rows (with activation checkpointing): the feature loss recomputed in backward, the
    full-vocabulary soft-CE chunk by chunk of positions (losses.chunked_soft_ce): no [N, V] tensor of
    the target's vocabulary at any time."""
    g = t if g is None else g
    features = activation_checkpoint(
        _feature_part, state, batch.final_hidden, b, t, g, k, use_reentrant=False
    )
    soft_ce, argmax = chunked_soft_ce(
        draft.logits, state, (b, t), batch.target_p, (b, g + k), draft.lm_head.weight.shape[0]
    )
    return feature_weight * features + token_weight * soft_ce, (
        argmax == batch.target_ids[b, g + k]
    ).sum()


def eagle_forward(
    draft,
    batch: TargetBatch,
    ttt_steps: int = 1,
    step_weight: float = 0.8,
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
    checkpoint: bool = False,
    shard=None,
    inputs=None,
) -> ObjectiveOutput:
    """shard: context parallelism, inputs: what the slots read instead of the token ids (MSD), both as
    spec_cli/draft/unroll.py's unroll takes them."""
    if batch.final_hidden is None:
        raise ConfigError(
            "EAGLE-1/2 trains on the target's final hidden states and this supervision has none",
            "train from a `spec precompute --algorithm eagle` cache, a live --target or a server",
        )
    head = partial(
        _chunked_head if checkpoint else _head,
        feature_weight=feature_weight,
        token_weight=token_weight,
    )
    head.recomputes = checkpoint
    features = batch.final_hidden if shard is None else shard.local(batch.final_hidden)
    return unroll(
        draft,
        batch,
        draft.project(features),
        head,
        batch.loss_mask,
        ttt_steps,
        step_weight,
        checkpoint,
        shard,
        inputs,
    )


class EagleObjective(Objective):
    """The draft and its loss behind one forward(batch), so DDP can wrap it."""

    def __init__(self, draft, options, activation_checkpointing: bool = False):
        super().__init__()
        if options.loss != "soft-ce":
            raise ConfigError(
                f"--loss {options.loss} scores a draft vocabulary's acceptance; EAGLE-1/2 "
                "trains on features and the target's distribution",
                "drop --loss",
            )
        self.draft = draft
        self.kw = dict(
            ttt_steps=options.ttt_steps,
            step_weight=options.step_weight,
            feature_weight=options.feature_weight,
            token_weight=options.token_weight,
            checkpoint=activation_checkpointing,
        )
        self.context_halo = (
            options.ttt_steps + 1
        )  # slots past its own it reads: features at t + k + 1

    def forward(self, batch, unit=None):
        batch, shard = self.context_shard(batch, halo=self.context_halo)
        return eagle_forward(self.draft, batch, **self.kw, shard=shard)
