"""DFlash's training objective: every slot anchors a block, and block offset j is scored against the
target's own next-token distribution where vLLM's j-th mask stands.

Elements. Slot t's block holds x[t + 1] (known) and b - 1 masks at positions t + 2 .. t + b; offset j
proposes x[t + 1 + j]. The batch is shifted (spec_cli/batch.py): row s holds token x[s + 1] and the target's
distribution for x[s + 2], so offset j is scored at s = t + j - 1 (target_p, target_ids, loss_mask and
position_mask there): offset 1 predicts what EAGLE-3's step 0 predicts at slot t, offset j what its TTT
step j - 1 does (spec_cli/draft/unroll.py). An element counts while s stays in t's document and loss_mask
holds at s; it carries a loss where the target's top-1 is in the draft vocab (position_mask at s). By default
every slot is an anchor (every anchor adds supervision); --max-anchors N draws N random anchors per row and
step among the slots with an element to score, as the peers do (512 in speculators), and runs only their
blocks (DFlashDraft.anchor_forward): a step's cost is then N x b queries a row, not T x b.

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
from torch._subclasses.fake_tensor import is_fake

from spec_cli.batch import TargetBatch
from spec_cli.draft.attention import document_index
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
    counted = torch.stack(
        [(remaining > k) & shift_left(batch.loss_mask, k).bool() for k in range(size - 1)]
    )
    supervised = counted & torch.stack(
        [shift_left(batch.position_mask, k).bool() for k in range(size - 1)]
    )
    return counted, supervised


def doc_starts(batch: TargetBatch) -> torch.Tensor:
    """[B, T] the first slot of each slot's document (packed rows: of its document; else 0)."""
    B, T = batch.attention_mask.shape
    if batch.seq_lens is None:
        return torch.zeros(B, T, dtype=torch.long, device=batch.attention_mask.device)
    lens = batch.seq_lens.long()
    starts = lens.cumsum(1) - lens  # [B, D]
    return starts.gather(1, document_index(lens, T).clamp_max(lens.shape[1] - 1))


def choose_anchors(
    eligible: torch.Tensor, count: int, training: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` anchor slots of each row, uniformly among the `eligible` [B, T] ones: (anchors [B, A],
    valid [B, A]; rows with fewer eligible slots fill up with invalid ones). In training the scores come
    from the batch device's own generator, which checkpoints store (the CPU's, or the GPU's: a resume draws
    the same anchors) and nothing reaches the host; an evaluation draws with a fixed seed and leaves that
    generator alone (the same anchors every evaluation, and training's draws do not depend on when it
    evaluates)."""
    B, T = eligible.shape
    if is_fake(eligible):  # `spec plan`: shapes only, the first slots stand for any
        anchors = torch.arange(min(count, T), device=eligible.device).expand(B, -1)
        return anchors, torch.ones_like(anchors, dtype=torch.bool)
    fixed = None if training else torch.Generator(eligible.device).manual_seed(0)
    scores = torch.rand(B, T, device=eligible.device, generator=fixed)
    top, anchors = torch.where(eligible, scores, -1.0).topk(min(count, T), dim=1)
    return anchors, top >= 0


def run_blocks(
    draft: DFlashDraft,
    batch: TargetBatch,
    size: int,
    first: int,
    max_anchors: int,
    checkpoint: bool,
    training: bool = True,
):
    """The block forward of a training batch and where each element is scored: (states per element row k
    [B, T or A, H], counted per k [K], [(where, at)] per k: index tuples of its supervised elements into
    the states and into the batch's targets, supervised per k [K]). Element row k (DFlash offset k + 1,
    DSpark query k) of the block anchored at slot t is scored at t + k. max_anchors > 0: that many random
    anchors per row (anchor_forward), else every slot (block_forward)."""
    K = size - first
    counted, supervised = element_masks(batch, K + 1)
    if not max_anchors:
        slots, n_supervised, segments = step_slots(supervised, batch.attention_mask, batch.seq_lens)
        states = draft.block_forward(
            batch.input_ids,
            batch.aux_hidden,
            positions(batch),
            segments,
            size,
            checkpoint,
            first=first,
        )
        pairs = [((rows, t), (rows, t + k)) for k, (rows, t) in enumerate(slots)]
        return states, counted.flatten(1).sum(1), pairs, n_supervised
    anchors, valid = choose_anchors(
        counted.any(0), max_anchors, training
    )  # slots with an element to score
    index = anchors.expand(K, -1, -1)
    counted, supervised = (
        counted.gather(2, index) & valid,
        supervised.gather(2, index) & valid,
    )  # [K, B, A]
    slots, n_supervised, _ = step_slots(supervised, torch.ones_like(anchors), None)
    states = draft.anchor_forward(
        batch.input_ids,
        batch.aux_hidden,
        positions(batch),
        anchors,
        doc_starts(batch),
        size,
        checkpoint,
        first=first,
    )
    pairs = [((rows, i), (rows, anchors[rows, i] + k)) for k, (rows, i) in enumerate(slots)]
    return states, counted.flatten(1).sum(1), pairs, n_supervised


class DFlashObjective(Objective):
    """The draft and its DFlash loss behind one forward(batch), so DDP can wrap it."""

    def __init__(self, draft: DFlashDraft, options, activation_checkpointing: bool = False):
        super().__init__()
        if options.loss not in LOSSES:
            raise ConfigError(
                f"--loss {options.loss} is not a per-element loss, and DFlash's loss is a weighted "
                "mean over block elements",
                f"use --loss {' or --loss '.join(LOSSES)} with --algorithm dflash",
            )
        if options.block_size != draft.block_size:
            raise ConfigError(
                f"--block-size {options.block_size} differs from the draft's {draft.block_size} "
                "(the block size is part of the draft)",
                f"pass --block-size {draft.block_size}",
            )
        self.draft = draft
        self.loss = options.loss
        self.size = draft.block_size
        self.decay = options.block_decay or default_decay(self.size)
        self.max_anchors = options.max_anchors
        self.checkpoint = activation_checkpointing

    def forward(self, batch: TargetBatch, unit=None) -> ObjectiveOutput:
        draft, size = self.draft, self.size
        states, counted, pairs, n_supervised = run_blocks(
            draft, batch, size, 1, self.max_anchors, self.checkpoint, self.training
        )
        weights = offset_weights(size, self.decay)
        total = states[0].new_zeros((), dtype=torch.float32)
        den = sum(w * n for w, n in zip(weights, n_supervised.float().unbind(0)))
        losses, correct = [], []
        for k, (state, (where, at)) in enumerate(
            zip(states, pairs)
        ):  # offset j = k + 1, scored at t + k
            if (
                self.checkpoint and self.loss == "soft-ce"
            ):  # long rows: the head chunk by chunk, recomputed
                value, argmax = chunked_soft_ce(
                    draft.logits, state, where, batch.target_p, at, draft.config.draft_vocab_size
                )
                hits = top1_hits(argmax, draft.d2t, batch.target_ids[at])
            else:
                logits = draft.logits(state[where])  # [N, Vd]
                value = step_loss(logits, batch.target_p[at], batch.target_mass[at], self.loss)
                hits = top1_correct(logits.detach(), draft.d2t, batch.target_ids[at])
            total = total + weights[k] * value * n_supervised[k] / den.clamp_min(1e-12)
            losses.append(value.detach())
            correct.append(hits)
        return ObjectiveOutput(
            loss=total,
            step_loss=torch.stack(losses),
            correct=torch.stack(correct),
            total=counted,
            supervised=n_supervised,
        )
