"""DFlash's training objective: every slot anchors a block, and block offset j is scored against the
target's own next-token distribution where vLLM's j-th mask stands.

Elements. Slot t's block holds x[t + 1] (known) and b - 1 masks at positions t + 2 .. t + b; offset j
proposes x[t + 1 + j]. The batch is shifted (spec_cli/batch.py): row s holds token x[s + 1] and the target's
distribution for x[s + 2], so offset j is scored at s = t + j - 1 (target_p, target_ids, loss_mask and
position_mask there): offset 1 predicts what EAGLE-3's step 0 predicts at slot t, offset j what its TTT
step j - 1 does (spec_cli/draft/unroll.py). An element counts while s stays in t's document and loss_mask
holds at s; it carries a loss where the target's top-1 is in the draft vocab (position_mask at s). Every
slot is an anchor: the peers draw up to 512 random anchors per row, which this layout cannot skip cheaply,
and every anchor adds supervision.

Loss. Distillation: soft cross-entropy to the target's distribution over the draft vocab (KL up to the
target's entropy: what the speculators trainer does by default; SpecForge trains on the data's tokens,
which equal the target's greedy choices on regenerated data), or lk-alpha. Offset j's elements weigh
w_j = exp(-(j - 1) / G) (the DFlash paper's decay: the first drafts decide the acceptance length), and
the loss is the weighted mean over all supervised elements, sum_j w_j * sum_n loss_jn / sum_j w_j * N_j.
Metrics per offset: `step_loss` (the offset's mean), `correct` / `total` (top-1 hits over its counted
elements), `supervised`, as ObjectiveOutput reports TTT steps.
"""

from __future__ import annotations

import math

import torch

from spec_cli.batch import TargetBatch
from spec_cli.draft.contract import Objective
from spec_cli.draft.dflash import default_decay
from spec_cli.draft.dflash.model import DFlashDraft
from spec_cli.draft.losses import chunked_soft_ce, step_loss, top1_correct, top1_hits
from spec_cli.draft.unroll import ObjectiveOutput, doc_remaining, positions, shift_left, step_slots
from spec_cli.errors import ConfigError

LOSSES = ("soft-ce", "lk-alpha")  # per-element losses (a weighted mean over elements)


def offset_weights(size: int, decay: float) -> list[float]:
    """w_j = exp(-(j - 1) / decay) for block offsets j = 1 .. size - 1."""
    return [math.exp(-(j - 1) / decay) for j in range(1, size)]


def element_masks(batch: TargetBatch, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counted, supervised) [size - 1, B, T] bool: offset j (row j - 1) of slot t's block is scored at
    row s = t + j - 1, which must be in t's document with loss_mask set; supervised also needs
    position_mask there."""
    remaining = doc_remaining(batch.attention_mask, batch.seq_lens)
    counted = torch.stack([(remaining > k) & shift_left(batch.loss_mask, k).bool() for k in range(size - 1)])
    supervised = counted & torch.stack([shift_left(batch.position_mask, k).bool() for k in range(size - 1)])
    return counted, supervised


class DFlashObjective(Objective):
    """The draft and its DFlash loss behind one forward(batch), so DDP can wrap it."""

    def __init__(self, draft: DFlashDraft, options, activation_checkpointing: bool = False):
        super().__init__()
        if options.loss not in LOSSES:
            raise ConfigError(f"--loss {options.loss} is not a per-element loss, and DFlash's loss is a weighted "
                              "mean over block elements", f"use --loss {' or --loss '.join(LOSSES)} with --algorithm dflash")
        if options.block_size != draft.block_size:
            raise ConfigError(f"--block-size {options.block_size} differs from the draft's {draft.block_size} "
                              "(the block size is part of the draft)", f"pass --block-size {draft.block_size}")
        self.draft = draft
        self.loss = options.loss
        self.size = draft.block_size
        self.decay = options.block_decay or default_decay(self.size)
        self.checkpoint = activation_checkpointing

    def forward(self, batch: TargetBatch, unit=None) -> ObjectiveOutput:
        draft, size = self.draft, self.size
        counted, supervised = element_masks(batch, size)
        slots, n_supervised, segments = step_slots(supervised, batch.attention_mask, batch.seq_lens)
        states = draft.block_forward(batch.input_ids, batch.aux_hidden, positions(batch), segments, size,
                                     self.checkpoint)
        weights = offset_weights(size, self.decay)
        total = states[0].new_zeros((), dtype=torch.float32)
        den = sum(w * n for w, n in zip(weights, n_supervised.float().unbind(0)))
        losses, correct = [], []
        for k, (state, (rows, t)) in enumerate(zip(states, slots)):  # offset j = k + 1, scored at t + k
            if self.checkpoint and self.loss == "soft-ce":  # long rows: the head chunk by chunk, recomputed
                value, argmax = chunked_soft_ce(draft.logits, state, (rows, t), batch.target_p, (rows, t + k),
                                                draft.config.draft_vocab_size)
                hits = top1_hits(argmax, draft.d2t, batch.target_ids[rows, t + k])
            else:
                logits = draft.logits(state[rows, t])  # [N, Vd]
                value = step_loss(logits, batch.target_p[rows, t + k], batch.target_mass[rows, t + k], self.loss)
                hits = top1_correct(logits.detach(), draft.d2t, batch.target_ids[rows, t + k])
            total = total + weights[k] * value * n_supervised[k] / den.clamp_min(1e-12)
            losses.append(value.detach())
            correct.append(hits)
        return ObjectiveOutput(loss=total, step_loss=torch.stack(losses), correct=torch.stack(correct),
                               total=counted.flatten(1).sum(1), supervised=n_supervised)
