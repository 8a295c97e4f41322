"""P-EAGLE's training objective: COD-sampled rollouts, one forward for all depths, a count-normalised
loss, and sequence partitioning into segments that each run their own forward and backward.

Elements. Slot t of a row is an anchor; its depth-0 element is EAGLE-3's step 0 (token t + 1, the
target's aux states at t) and its depth-d element the d-th mask slot after it (position t + d). The
element at depth d is supervised by the target at t + d, exactly where TTT step d supervises slot t
(spec_cli/draft/unroll.py): loss_mask, position_mask, target_p and target_ids at t + d, and only while
d < doc_remaining[t] (the target stays in t's document, packing and padding alike).

COD sampling (Conditional-On-Distribution). Depth 0 keeps every slot. Depth d >= 1 keeps, per row,
int(max(cod_ratio**d, cod_min) * n_d) elements, n_d being the row's anchors that are valid at depth d
(target in the document, loss_mask set); they are drawn uniformly from the anchors kept at depth d - 1
that are still valid, so every kept element has its whole rollout below it. The draw of an anchor is a
hash of (the batch's seed, one draw of torch's RNG, so a resumed run draws the same; depth; row; slot):
it does not depend on the row's padded width, so a row split over a context-parallel group (padded to
its chunks, each rank sampling the whole rows and keeping its anchors) keeps the elements one process
keeps. Evaluation keeps every valid element (exact metrics, no sampling).

Context parallelism (spec_cli/draft/context.py). An anchor's rollout lives on the rank holding the
anchor; its depth-0 keys are gathered once per layer (ContextBias), the depths' grids stay local, and
the loss and per-depth losses are the rank's shares over the whole batch's counts.

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
from spec_cli.draft.attention import Segments
from spec_cli.draft.contract import Objective
from spec_cli.draft.losses import chunked_soft_ce, step_loss, top1_correct, top1_hits
from spec_cli.draft.peagle.model import PEagleDraft
from spec_cli.draft.unroll import ObjectiveOutput, doc_remaining, positions, shift_left
from spec_cli.errors import ConfigError

LOSSES = (
    "soft-ce",
    "lk-alpha",
)  # per-element losses: they add up over elements (lk-lambda does not)


@dataclass
class Unit:
    """One forward/backward of a batch: depth-0 slots [0, end) run, [start, end) are charged; the
    depth-0 elements it charges are depth0 = (rows, anchors), the depth-d ones it owns
    rollouts[d - 1]. Sizes are host ints, fetched once for the whole batch (`PEagleObjective.plan`)."""

    start: int
    end: int
    rollouts: list[tuple[torch.Tensor, torch.Tensor]]
    depth_den: list[int]  # [K] the batch's supervised elements per depth (all units)
    total_den: int  # their sum
    depth0: tuple[torch.Tensor, torch.Tensor] | None = None
    segments: Segments | None = (
        None  # the packed documents of the slots [0, end) (None: not packed)
    )


def valid_depths(batch: TargetBatch, depths: int, shard=None) -> torch.Tensor:
    """[K, B, T] bool: the depth-d element of anchor t has a scored target (t + d in t's document,
    loss_mask at t + d). shard (context parallelism): [K, B, 2c] of this rank's anchors."""
    return _depth_masks(batch, depths, batch.loss_mask, shard)


def _depth_masks(batch: TargetBatch, depths: int, mask: torch.Tensor, shard=None) -> torch.Tensor:
    """[K, B, T] (or this rank's [K, B, 2c]): t + d in t's document and mask at t + d."""
    remaining = doc_remaining(
        batch.attention_mask, batch.seq_lens
    )  # (whole rows, also in a rank's batch)
    if shard is None:
        return torch.stack([(remaining > d) & shift_left(mask, d).bool() for d in range(depths)])
    remaining = shard.owned(remaining)
    return torch.stack([(remaining > d) & shard.local(mask, d).bool() for d in range(depths)])


P = 2147483647  # 2**31 - 1: COD's scores are integers modulo this prime (products stay below 2**63)


def _mix(h: torch.Tensor) -> torch.Tensor:
    """An integer hash step on [0, P): modular multiplies (bijective on [1, P)) with xor-shifts between
    them, so that neighbouring inputs give unrelated outputs. int64 arithmetic, the same on every device."""
    for multiplier, shift in ((48271, 15), (69621, 13), (16807, 16)):
        h = (h * multiplier) % P
        h = h ^ (h >> shift)
    return h % P


def cod_scores(seed: torch.Tensor, depth: int, rows: int, length: int) -> torch.Tensor:
    """[rows, length] float64 in [0, 1): COD's draw for each (row, anchor) at `depth`, a hash of
    (seed, depth, row, anchor). A slot's draw depends on its place in the row only, never on the row's
    padded width or on which rank holds it, so a row split over a context-parallel group, or padded
    to its chunks, keeps the same elements as the whole row in one process."""
    device = seed.device
    h = _mix((_mix(seed % P) + depth) % P)
    h = _mix((h + torch.arange(rows, device=device)[:, None]) % P)
    h = _mix((h + torch.arange(length, device=device)[None]) % P)
    return h.double() / P


def rollout_masks(
    valid: torch.Tensor,
    ratio: float,
    floor: float,
    sample: bool = True,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """COD sampling (module docstring). valid [K, B, T] -> the kept elements [B, T] of depths 1..K-1,
    on the device (no host sync). One seed per call from torch's RNG on valid's device (`generator`,
    else that device's default one: the ranks of a group draw alike, and a checkpoint restores it on
    each rank's own device); each anchor's draw is `cod_scores`'s."""
    K, B, T = valid.shape
    kept = valid[1] if K > 1 else None
    out = []
    seed = (
        torch.randint(0, P, (), generator=generator, device=valid.device)
        if sample and K > 1
        else None
    )
    for d in range(1, K):
        candidates = valid[d] if d == 1 else kept & valid[d]  # [B, T]
        if sample:
            want = (valid[d].sum(1).double() * max(ratio**d, floor)).long()  # [B] per row
            score = torch.where(candidates, cod_scores(seed, d, B, T), 2.0)  # candidates first
            rank = score.argsort(dim=1, stable=True).argsort(
                1
            )  # [B, T] each slot's rank in its row
            kept = candidates & (rank < want[:, None])
        else:
            kept = candidates
        out.append(kept)
    return out


def sample_rollouts(
    valid: torch.Tensor,
    ratio: float,
    floor: float,
    sample: bool = True,
    generator: torch.Generator | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """rollout_masks as (rows, anchors) sorted by (row, anchor), depths 1..K-1 (one sync per depth)."""
    return [
        kept.nonzero(as_tuple=True)
        for kept in rollout_masks(valid, ratio, floor, sample, generator)
    ]


def plan_units(
    batch: TargetBatch,
    valid: torch.Tensor,
    kept: list[torch.Tensor],
    supervised: torch.Tensor,
    segments: int,
    whole: tuple | None = None,
) -> list[Unit]:
    """The batch's units (module docstring "Segments") with one host sync for all their sizes, the
    supervised counts and the packed documents. valid / supervised [K, B, T]; kept [B, T] per depth >= 1.
    whole (context parallelism): (supervised, kept) of the whole rows, which count the denominators; the
    other masks are this rank's anchors, its one unit charges them all, and its documents are the whole
    rows' (the ContextBias the forward makes)."""
    K, B, T = valid.shape
    bounds = [round(i * T / max(segments, 1)) for i in range(max(segments, 1) + 1)]
    ranges = [(a, e) for a, e in zip(bounds[:-1], bounds[1:]) if e > a]
    t = torch.arange(T, device=valid.device)
    charged = []  # per unit: its depth-0 anchors, then its deep elements by depth
    for a, e in ranges:
        if whole is not None:  # a rank's one unit: all its anchors (their slots are not contiguous)
            charged.append([valid[0]] + list(kept))
            continue
        owned = (t + 1 >= a) & (t + 1 < e)  # by its depth-1 element's position (anchor + 1)
        charged.append([valid[0] & (t >= a) & (t < e)] + [k & owned for k in kept])
    every_sup, every_kept = whole if whole is not None else (supervised, kept)
    den = [every_sup[0]] + [every_sup[d] & every_kept[d - 1] for d in range(1, K)]
    counts = torch.stack([m.sum() for unit in charged for m in unit] + [m.sum() for m in den])
    host = [counts] + ([] if batch.seq_lens is None else [batch.seq_lens.long().flatten()])
    sizes = torch.cat(
        host
    ).tolist()  # the one sync: element sets and documents have data-dependent sizes
    per_unit, depth_den, lengths = (
        len(kept) + 1,
        sizes[len(counts) - K : len(counts)],
        sizes[len(counts) :],
    )
    units = []
    for i, ((a, e), masks) in enumerate(zip(ranges, charged)):
        picked = [_elements(m, n) for m, n in zip(masks, sizes[i * per_unit : (i + 1) * per_unit])]
        if batch.seq_lens is None:
            documents = None
        elif whole is not None:
            D = batch.seq_lens.shape[1]
            documents = Segments.from_lengths(
                [lengths[b * D : (b + 1) * D] for b in range(B)], batch.attention_mask.shape[1]
            )
        else:
            documents = _clipped_segments(lengths, B, e)
        units.append(Unit(a, e, picked[1:], depth_den, sum(depth_den), picked[0], documents))
    return units


def _elements(mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, anchors) of the n True entries of mask [B, T], sorted by (row, anchor): no host sync."""
    T = mask.shape[1]
    flat = torch.nonzero_static(mask.reshape(-1), size=n).squeeze(1)
    return flat // T, flat % T


def _clipped_segments(lengths: list[int], B: int, end: int) -> Segments:
    """The documents of rows of `lengths` (host ints, B rows of D) cut at slot `end`."""
    D = len(lengths) // B
    rows = []
    for b in range(B):
        left, row = end, []
        for n in lengths[b * D : (b + 1) * D]:
            row.append(min(n, left))
            left -= row[-1]
        rows.append(row)
    return Segments.from_lengths(rows, end)


def _head(
    draft: PEagleDraft, states, batch: TargetBatch, rows, anchors, d: int, supervised, loss: str
):
    """Depth d's (loss sum over its supervised elements, top-1 hits over all of them): states [N, H] of
    the scored elements (rows, anchors), supervised [N] bool; `anchors` index the batch's slots (under
    context parallelism: where the rank's anchors sit in it, its targets d slots on). The loss runs over
    all N with the unsupervised elements' target zeroed, which adds exactly nothing (soft-CE: no mass to
    match; lk-alpha: alpha 0 is skipped), so that no host sync picks the supervised ones."""
    logits = draft.logits(states)  # [N, Vd]
    t = anchors + d
    n = rows.shape[0]
    value = (
        step_loss(
            logits,
            batch.target_p[rows, t] * supervised[:, None],
            batch.target_mass[rows, t] * supervised,
            loss,
        )
        * n
    )
    return value, top1_correct(logits.detach(), draft.d2t, batch.target_ids[rows, t])


def _chunked_head(
    draft: PEagleDraft, states, batch: TargetBatch, rows, anchors, d: int, supervised
):
    """_head's soft-CE for long rows (with activation checkpointing): chunk by chunk of elements,
    recomputed in backward, never an [N, Vd] tensor (losses.chunked_soft_ce). Anchors as _head's."""
    n = rows.shape[0]
    value, argmax = chunked_soft_ce(
        draft.logits,
        states,
        (torch.arange(n, device=rows.device),),
        batch.target_p,
        (rows, anchors + d),
        draft.config.draft_vocab_size,
        weight=supervised.to(batch.target_p.dtype),
    )
    return value * n, top1_hits(argmax, draft.d2t, batch.target_ids[rows, anchors + d])


class PEagleObjective(Objective):
    """The draft and its P-EAGLE loss behind one forward(batch, unit), so DDP can wrap it."""

    def __init__(self, draft: PEagleDraft, options, activation_checkpointing: bool = False):
        super().__init__()
        if options.loss not in LOSSES:
            raise ConfigError(
                f"--loss {options.loss} is not a per-element loss, and P-EAGLE's loss is a sum over "
                "elements (so that segments add up to the batch's loss)",
                f"use --loss {' or --loss '.join(LOSSES)} with --algorithm peagle",
            )
        if not 0 < options.cod_ratio <= 1 or not 0 <= options.cod_min <= 1:
            raise ConfigError(
                f"--cod-ratio {options.cod_ratio} / --cod-min {options.cod_min} must be fractions "
                "(ratio in (0, 1], floor in [0, 1])",
                "e.g. --cod-ratio 0.7 --cod-min 0.2",
            )
        if options.peagle_segments < 1:
            raise ConfigError(
                "--peagle-segments must be at least 1", "1 runs each batch as one forward"
            )
        self.draft = draft
        self.options = options
        self.depths = options.ttt_steps
        self.checkpoint = activation_checkpointing
        self.context_halo = max(
            options.ttt_steps - 1, 0
        )  # slots past its own an anchor reads (t + d, d < K)

    @property
    def context(self):
        return getattr(self, "_context", None)

    @context.setter
    def context(self, value) -> None:
        """--context-parallel (set by the trainer): segments would cut a rank's slots again, below the
        split the group already makes, so the two are not combined."""
        if value is not None and value.size > 1 and self.options.peagle_segments > 1:
            raise ConfigError(
                f"--peagle-segments {self.options.peagle_segments} with --context-parallel "
                f"{value.size}: both cut a row to hold fewer activations, and P-EAGLE splits a row "
                "one way at a time",
                "drop --peagle-segments (context parallelism already "
                "divides each rank's activations by the group's size)",
            )
        object.__setattr__(self, "_context", value)

    def plan(self, batch: TargetBatch, sample: bool | None = None) -> list[Unit]:
        """COD-sample the batch's rollouts once and cut them into segments (one host sync). Under context
        parallelism each rank samples the whole rows (their masks gathered once, a byte per slot and
        depth), so the group keeps the elements one process keeps; a rank's one unit holds its anchors'."""
        sample = self.training if sample is None else sample
        K, options = self.depths, self.options
        batch, shard = self.context_shard(batch, halo=self.context_halo)
        valid = valid_depths(batch, K, shard)
        supervised = valid & _depth_masks(batch, K, batch.position_mask, shard)
        if shard is None:
            kept = rollout_masks(valid, options.cod_ratio, options.cod_min, sample)
            return plan_units(
                batch, valid, kept, supervised, options.peagle_segments if sample else 1
            )
        rows = shard.gather(
            torch.cat([valid, supervised]).to(torch.uint8), 2
        ).bool()  # [2K, B, T] whole rows
        every = rollout_masks(rows[:K], options.cod_ratio, options.cod_min, sample)
        kept = [shard.owned(k) for k in every]
        return plan_units(batch, valid, kept, supervised, 1, whole=(rows[K:], every))

    def forward(self, batch: TargetBatch, unit: Unit | None = None) -> ObjectiveOutput:
        if unit is None:  # one forward over the whole batch (evaluation, direct calls)
            unit = self.plan(batch)
            unit = unit[0] if len(unit) == 1 else split_back(unit)
        return self._run(batch, unit)

    def _run(self, batch: TargetBatch, unit: Unit) -> ObjectiveOutput:
        draft, K, end = self.draft, self.depths, unit.end
        batch, shard = self.context_shard(batch, halo=self.context_halo)
        position_ids = positions(batch)
        if shard is None:
            ids, aux, position_ids, bias = (
                batch.input_ids[:, :end],
                batch.aux_hidden[:, :end],
                position_ids[:, :end],
                unit.segments,
            )
        else:  # this rank's anchors; the attention reads the whole rows' depth-0 keys (context.py)
            from spec_cli.draft.context import ContextBias, whole_rows

            ids, aux, position_ids = (
                shard.local(batch.input_ids),
                shard.local(batch.aux_hidden),
                shard.owned(position_ids),
            )
            bias = ContextBias(
                shard,
                unit.segments
                if unit.segments is not None
                else whole_rows(*batch.attention_mask.shape),
            )
            where = shard.in_batch(ids.device)  # each local anchor's slot in the batch
        state0, deep = draft.parallel_forward(ids, aux, position_ids, bias, unit.rollouts)
        rows0, anchors0 = unit.depth0  # the depth-0 elements it charges: anchors in [start, end)
        if self.checkpoint and self.options.loss == "soft-ce":
            score = _chunked_head  # recomputes its chunks itself
        else:
            head = partial(_head, loss=self.options.loss)
            score = (
                (lambda *a: activation_checkpoint(head, *a, use_reentrant=False))
                if self.checkpoint
                else head
            )
        # the mask state takes part in every unit's graph (DDP expects a gradient for every parameter)
        total = draft.mask_hidden().sum() * 0.0
        losses, correct, scored, counted = [], [], [], []
        for d in range(K):
            if d == 0:
                rows, anchors, states = rows0, anchors0, state0[rows0, anchors0]
            else:
                rows, anchors = (
                    unit.rollouts[d - 1]
                    if d - 1 < len(unit.rollouts)
                    else (rows0[:0], anchors0[:0])
                )
                states = deep[d - 1] if d - 1 < len(deep) else state0.new_zeros(0, state0.shape[-1])
            at = anchors if shard is None else where[anchors]
            supervised = batch.position_mask[rows, at + d].bool()
            value, hits = score(draft, states, batch, rows, at, d, supervised)
            total = total + value / max(unit.total_den, 1)
            losses.append(value.detach() / max(unit.depth_den[d], 1))
            correct.append(hits)
            scored.append(rows.new_full((), rows.shape[0]))  # a fill on the device: no host copy
            counted.append(supervised.sum())
        return ObjectiveOutput(
            loss=total,
            step_loss=torch.stack(losses),
            correct=torch.stack(correct),
            total=torch.stack(scored),
            supervised=torch.stack(counted),
        )


def split_back(units: list[Unit]) -> Unit:
    """Segments joined into one unit (a single forward over the same elements)."""

    def join(parts):
        rows, anchors = torch.cat([r for r, _ in parts]), torch.cat([a for _, a in parts])
        order = (rows * (10**9) + anchors).argsort()
        return rows[order], anchors[order]

    K = len(units[0].rollouts)
    joined = [join([u.rollouts[d] for u in units]) for d in range(K)]
    return Unit(
        0,
        units[-1].end,
        joined,
        units[0].depth_den,
        units[0].total_den,
        join([u.depth0 for u in units]),
        units[-1].segments,
    )
