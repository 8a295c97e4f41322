"""P-EAGLE's training objective: COD-sampled rollouts, one forward for all depths, a count-normalised
loss, and sequence partitioning into segments that each run their own forward and backward.

Elements. Slot t of a row is an anchor; its depth-0 element is EAGLE-3's step 0 (token t + 1, the
target's aux states at t) and its depth-d element the d-th mask slot after it (position t + d). The
element at depth d is supervised by the target at t + d, exactly where TTT step d supervises slot t
(spec_cli/draft/unroll.py): loss_mask, position_mask, target_p and target_ids at t + d, and only while
d < doc_remaining[t] (the target stays in t's document, packing and padding alike).

COD sampling (Conditional-On-Distribution). Depth 0 keeps every slot. Depth d >= 1 keeps, per row,
int(max(cod_ratio**d, cod_min) * n_d) elements, n_d being the row's anchors that are valid at depth d
(target in the document, loss_mask set); they are drawn uniformly (torch's RNG, so a resumed run
draws the same) from the anchors kept at depth d - 1 that are still valid, so every kept element has
its whole rollout below it. Evaluation keeps every valid element (exact metrics, no sampling).

Loss. Every supervised element (position_mask) contributes its per-element loss (soft-CE, i.e. KL
up to the target's entropy, or lk-alpha's -log alpha); the batch loss is their sum over
`total_den`, the batch's supervised element count over all depths. Per depth, `step_loss` is that
depth's mean, `correct` / `total` the top-1 hits over its loss_mask elements (sums, as ObjectiveOutput).

Segments (--peagle-segments P > 1). The row's slots are cut into P equal ranges; a depth-0 element
and a depth-1 element belong to the range holding their position (anchor + depth), a deeper element
to its depth-1 parent's. Segment i runs the slots [0, end_i) at depth 0 (the earlier slots ride along
as keys and values: "causal completion"), its own deep elements, and charges only what it owns, over
the same total_den: the segments' losses and gradients add up to the single forward's. The trainer
back-propagates each segment before the next forward, so only one segment's graph is alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from spec_cli.batch import TargetBatch
from spec_cli.draft.contract import Objective
from spec_cli.draft.attention import Segments
from spec_cli.draft.losses import step_loss, top1_correct
from spec_cli.draft.peagle.model import PEagleDraft
from spec_cli.draft.unroll import ObjectiveOutput, doc_remaining, positions, shift_left
from spec_cli.errors import ConfigError

LOSSES = ("soft-ce", "lk-alpha")  # per-element losses: they add up over elements (lk-lambda does not)


@dataclass
class Unit:
    """One forward/backward of a batch: depth-0 slots [0, end) run, [start, end) are charged; the
    depth-d elements it owns are rollouts[d - 1] = (rows, anchors)."""
    start: int
    end: int
    rollouts: list[tuple[torch.Tensor, torch.Tensor]]
    depth_den: torch.Tensor  # [K] the batch's supervised elements per depth (all units)
    total_den: int  # their sum


def valid_depths(batch: TargetBatch, depths: int) -> torch.Tensor:
    """[K, B, T] bool: the depth-d element of anchor t has a scored target (t + d in t's document,
    loss_mask at t + d)."""
    remaining = doc_remaining(batch.attention_mask, batch.seq_lens)
    return torch.stack([(remaining > d) & shift_left(batch.loss_mask, d).bool() for d in range(depths)])


def sample_rollouts(valid: torch.Tensor, ratio: float, floor: float, sample: bool = True,
                    generator: torch.Generator | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """COD sampling (module docstring). valid [K, B, T] -> [(rows, anchors)] for depths 1..K-1."""
    K, B, T = valid.shape
    kept = valid[1] if K > 1 else None
    out = []
    for d in range(1, K):
        candidates = valid[d] if d == 1 else kept & valid[d]  # [B, T]
        if sample:
            want = (valid[d].sum(1).double() * max(ratio ** d, floor)).long()  # [B] per row
            score = torch.rand(B, T, generator=generator, device=valid.device)
            score = torch.where(candidates, score, torch.full_like(score, 2.0))  # candidates first
            rank = score.argsort(1).argsort(1)  # [B, T] each slot's rank in its row
            kept = candidates & (rank < want[:, None])
        else:
            kept = candidates
        rows, anchors = kept.nonzero(as_tuple=True)  # sorted by (row, anchor)
        out.append((rows, anchors))
    return out


def split(rollouts, valid: torch.Tensor, supervised: torch.Tensor, segments: int) -> list[Unit]:
    """The batch's units (module docstring "Segments"). supervised [K, B, T]: elements with a loss."""
    K, B, T = valid.shape
    den = [int(supervised[0].sum())] + [int(supervised[d][rows, anchors].sum())
                                        for d, (rows, anchors) in enumerate(rollouts, start=1)]
    depth_den, total = torch.tensor(den), sum(den)
    if segments <= 1:
        return [Unit(0, T, rollouts, depth_den, total)]
    bounds = [round(i * T / segments) for i in range(segments + 1)]
    units = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        owned = []
        if rollouts:
            rows1, anchors1 = rollouts[0]
            mine = torch.zeros(B, T, dtype=torch.bool, device=valid.device)
            pos1 = anchors1 + 1  # depth-1 elements sit at anchor + 1
            sel = (pos1 >= start) & (pos1 < end)
            mine[rows1[sel], anchors1[sel]] = True  # the rollouts this segment owns (by their depth-1 element)
            for rows, anchors in rollouts:
                keep = mine[rows, anchors]
                owned.append((rows[keep], anchors[keep]))
        units.append(Unit(start, end, owned, depth_den, total))
    return units


def clip_seq_lens(seq_lens: torch.Tensor, end: int) -> torch.Tensor:
    """[B, D] document lengths of rows cut at slot `end`."""
    ends = seq_lens.long().cumsum(1).clamp_max(end)
    return torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))


def _head(draft: PEagleDraft, states, batch: TargetBatch, rows, anchors, d: int, supervised, loss: str):
    """Depth d's (loss sum over its supervised elements, top-1 hits over all of them): states [N, H] of
    the scored elements (rows, anchors), supervised [N] bool."""
    logits = draft.logits(states)  # [N, Vd]
    t = anchors + d
    sup = supervised.nonzero(as_tuple=True)[0]
    n = sup.numel()
    value = step_loss(logits[sup], batch.target_p[rows[sup], t[sup]], batch.target_mass[rows[sup], t[sup]],
                      loss) * n
    return value, top1_correct(logits.detach(), draft.d2t, batch.target_ids[rows, t])


class PEagleObjective(Objective):
    """The draft and its P-EAGLE loss behind one forward(batch, unit), so DDP can wrap it."""

    def __init__(self, draft: PEagleDraft, options, activation_checkpointing: bool = False):
        super().__init__()
        if options.loss not in LOSSES:
            raise ConfigError(f"--loss {options.loss} is not a per-element loss, and P-EAGLE's loss is a sum over "
                              "elements (so that segments add up to the batch's loss)",
                              f"use --loss {' or --loss '.join(LOSSES)} with --algorithm peagle")
        if not 0 < options.cod_ratio <= 1 or not 0 <= options.cod_min <= 1:
            raise ConfigError(f"--cod-ratio {options.cod_ratio} / --cod-min {options.cod_min} must be fractions "
                              "(ratio in (0, 1], floor in [0, 1])", "e.g. --cod-ratio 0.7 --cod-min 0.2")
        if options.peagle_segments < 1:
            raise ConfigError("--peagle-segments must be at least 1", "1 runs each batch as one forward")
        self.draft = draft
        self.options = options
        self.depths = options.ttt_steps
        self.checkpoint = activation_checkpointing

    def plan(self, batch: TargetBatch, sample: bool | None = None) -> list[Unit]:
        """COD-sample the batch's rollouts once and cut them into segments."""
        sample = self.training if sample is None else sample
        valid = valid_depths(batch, self.depths)
        rollouts = sample_rollouts(valid, self.options.cod_ratio, self.options.cod_min, sample)
        supervised = valid & torch.stack([shift_left(batch.position_mask, d).bool() for d in range(self.depths)])
        return split(rollouts, valid, supervised, self.options.peagle_segments if sample else 1)

    def forward(self, batch: TargetBatch, unit: Unit | None = None) -> ObjectiveOutput:
        if unit is None:  # one forward over the whole batch (evaluation, direct calls)
            unit = self.plan(batch)
            unit = unit[0] if len(unit) == 1 else split_back(unit)
        return self._run(batch, unit)

    def _run(self, batch: TargetBatch, unit: Unit) -> ObjectiveOutput:
        draft, K, end = self.draft, self.depths, unit.end
        position_ids = positions(batch)
        bias = Segments.from_seq_lens(clip_seq_lens(batch.seq_lens, end), end) if batch.seq_lens is not None \
            else None
        state0, deep = draft.parallel_forward(batch.input_ids[:, :end], batch.aux_hidden[:, :end],
                                              position_ids[:, :end], bias, unit.rollouts)
        valid0 = valid_depths(batch, 1)[0][:, :end]
        valid0[:, :unit.start] = False  # the slots before the segment are context only
        rows0, anchors0 = valid0.nonzero(as_tuple=True)
        head = partial(_head, loss=self.options.loss)
        score = (lambda *a: activation_checkpoint(head, *a, use_reentrant=False)) if self.checkpoint else head
        # the mask state takes part in every unit's graph (DDP expects a gradient for every parameter)
        total = draft.mask_hidden().sum() * 0.0
        losses, correct, scored, counted = [], [], [], []
        for d in range(K):
            if d == 0:
                rows, anchors, states = rows0, anchors0, state0[rows0, anchors0]
            else:
                rows, anchors = unit.rollouts[d - 1] if d - 1 < len(unit.rollouts) else (rows0[:0], anchors0[:0])
                states = deep[d - 1] if d - 1 < len(deep) else state0.new_zeros(0, state0.shape[-1])
            supervised = batch.position_mask[rows, anchors + d].bool()
            value, hits = score(draft, states, batch, rows, anchors, d, supervised)
            total = total + value / max(unit.total_den, 1)
            losses.append(value.detach() / max(int(unit.depth_den[d]), 1))
            correct.append(hits)
            scored.append(rows.new_tensor(rows.numel()))
            counted.append(rows.new_tensor(int(supervised.sum())))
        return ObjectiveOutput(loss=total, step_loss=torch.stack(losses), correct=torch.stack(correct),
                         total=torch.stack(scored), supervised=torch.stack(counted))


def split_back(units: list[Unit]) -> Unit:
    """Segments joined into one unit (a single forward over the same elements)."""
    K = len(units[0].rollouts)
    joined = [(torch.cat([u.rollouts[d][0] for u in units]), torch.cat([u.rollouts[d][1] for u in units]))
              for d in range(K)]
    order = [(rows * (10 ** 9) + anchors).argsort() for rows, anchors in joined]
    joined = [(rows[o], anchors[o]) for (rows, anchors), o in zip(joined, order)]
    return Unit(0, units[-1].end, joined, units[0].depth_den, units[0].total_den)
