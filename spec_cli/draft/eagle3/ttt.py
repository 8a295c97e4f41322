"""EAGLE-3's TTT objective: the shared unroll (spec_cli/draft/unroll.py) scored on the target's
distribution over the draft vocab.

Metrics per step:
- supervised: positions with a loss (position_mask: target top-1 in the draft vocab);
- correct / total: top-1 hits over the loss_mask positions (SpecForge's definition). A position whose
  target top-1 is outside the draft vocab counts as a miss: the draft can never propose it, so this
  is the honest proxy for acceptance. Hits can only occur where position_mask holds.
"""

from __future__ import annotations

from functools import partial

from spec_cli.batch import TargetBatch
from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.draft.losses import LOSSES, chunked_soft_ce, step_loss, top1_correct, top1_hits
from spec_cli.draft.unroll import ObjectiveOutput, unroll


def _head(
    draft: Eagle3Draft,
    hidden,
    batch: TargetBatch,
    b,
    t,
    k: int,
    g=None,
    *,
    loss,
    kl_scale,
    kl_decay,
    group_mean=None,
):
    """Step k's loss and top-1 hits at its N supervised slots (b, t) of `hidden`, whose targets sit at
    g + k in the batch's rows (g: the slots' indices there, t unless under context parallelism).
    Gathers inside, so that activation checkpointing keeps no [N, Vd] copy of target_p."""
    g = t if g is None else g
    logits = draft.logits(hidden[b, t])  # [N, Vd]
    target_p = batch.target_p[b, g + k]  # [N, Vd]
    value = step_loss(
        logits, target_p, batch.target_mass[b, g + k], loss, kl_scale, kl_decay, group_mean
    )
    return value, top1_correct(logits.detach(), draft.d2t, batch.target_ids[b, g + k])


def _chunked_head(draft: Eagle3Draft, hidden, batch: TargetBatch, b, t, k: int, g=None):
    """_head's soft-CE for long rows (with activation checkpointing): chunk by chunk of positions,
    recomputed in backward, never an [N, Vd] tensor (losses.chunked_soft_ce)."""
    g = t if g is None else g
    value, argmax = chunked_soft_ce(
        draft.logits, hidden, (b, t), batch.target_p, (b, g + k), draft.config.draft_vocab_size
    )
    return value, top1_hits(argmax, draft.d2t, batch.target_ids[b, g + k])


def ttt_forward(
    draft: Eagle3Draft,
    batch: TargetBatch,
    ttt_steps: int = 7,
    step_weight: float = 0.8,
    loss: str = "soft-ce",
    lk_kl_scale: float = 1.0,
    lk_kl_decay: float = 1.0,
    checkpoint: bool = False,
    shard=None,
) -> ObjectiveOutput:
    """Unroll the draft for `ttt_steps` steps on one batch; returns the weighted loss and metrics.

    checkpoint: recompute each step's decoder layers and its head/loss in backward (for long rows);
    activation memory then holds O(H) values per token and step instead of O(Vd + intermediate), and
    the soft-CE head runs in chunks of positions (no [N, Vd] tensor at any time).
    """
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}: use one of {', '.join(LOSSES)}")
    if checkpoint and loss == "soft-ce":
        head = partial(_chunked_head)
        head.recomputes = True
    else:
        head = partial(
            _head,
            loss=loss,
            kl_scale=lk_kl_scale,
            kl_decay=lk_kl_decay,
            group_mean=None if shard is None else shard.mean,
        )
    aux = batch.aux_hidden if shard is None else shard.local(batch.aux_hidden)
    return unroll(
        draft,
        batch,
        draft.project(aux),
        head,
        batch.position_mask,
        ttt_steps,
        step_weight,
        checkpoint,
        shard,
    )
