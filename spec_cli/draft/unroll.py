"""The training-time-test (TTT) unroll shared by the drafts that step one slot at a time (EAGLE-3,
EAGLE-1/2): one forward over whole rows per step, the draft's own state fed to the next step.

Teacher-forced rolling (docs/eagle.md "TTT unroll"): at step k slot t reads token input_ids[t + k] (the
ids rolled left by k) with the draft's own state of step k - 1 at slot t, and is supervised by the
target at t + k: loss_mask, position_mask, target_p, target_ids and target_mass roll with the ids.
The attention mask stays that of step 0; positions advance with the step (slot t sits at position
t + k at step k), as at serving, where the k-th drafted token is decoded at position t + k (vLLM,
SGLang and `spec eval` alike), and as SpecForge trains. Slot t takes part at step k only while its
target stays in its own document: k < doc_remaining[t] (right padding and packing alike).

What each step is scored on is the algorithm's `head(draft, state, batch, b, t, k) -> (loss, hits)`
at the supervised slots (b, t). Metrics per step, as sums so they add up across batches and ranks:
supervised (positions with a loss), correct / total (top-1 hits over the loss_mask positions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from spec_cli.batch import TargetBatch
from spec_cli.draft.attention import Segments, document_index
from spec_cli.draft.losses import acceptance_length, step_weights


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # [] sum_k w_k * loss_k, for backward
    step_loss: torch.Tensor  # [K] each step's loss (mean over its supervised positions), detached
    correct: torch.Tensor  # [K] top-1 hits
    total: torch.Tensor  # [K] loss_mask positions (accuracy denominator)
    supervised: torch.Tensor  # [K] position_mask positions (loss denominator)

    @property
    def accuracy(self) -> torch.Tensor:
        """[K] top-1 accuracy per step (0 where a step has no positions)."""
        return self.correct.double() / self.total.double().clamp_min(1)

    @property
    def acceptance_length(self) -> torch.Tensor:
        return acceptance_length(self.accuracy)

    def merge(self, outs: list[ObjectiveOutput]) -> ObjectiveOutput:
        """The outputs of one batch's units (each a share of its loss and sums) as one (detached)."""

        def total(name):
            return torch.stack([getattr(o, name).detach() for o in outs]).sum(0)

        return ObjectiveOutput(
            **{
                name: total(name)
                for name in ("loss", "step_loss", "correct", "total", "supervised")
            }
        )


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t] <- x[:, t + k], zero-filled at the end. [B, T, ...]."""
    if k == 0:
        return x
    return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], dim=1)


def doc_remaining(
    attention_mask: torch.Tensor, seq_lens: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, T] slots left in each slot's document, itself included (0 on padding). No host sync.

    Unpacked rows: a document is a run of attention_mask ones (right padding makes it the row's real
    tokens; a left-padded row is read the same way). Packed rows: documents of seq_lens [B, D] tokens,
    back to back."""
    B, T = attention_mask.shape
    t = torch.arange(T, device=attention_mask.device)
    if seq_lens is None:
        real = attention_mask.bool()
        zero_at = torch.where(real, T, t)  # [B, T] the slot's own index where it is padding
        next_zero = zero_at.flip(1).cummin(1).values.flip(1)  # first padding slot at or after t
        return torch.where(real, next_zero - t, 0)
    ends = seq_lens.long().cumsum(1)  # [B, D]
    doc = document_index(seq_lens, T)  # [B, T], D on trailing padding
    end = ends.gather(1, doc.clamp_max(ends.shape[1] - 1))
    return torch.where(doc < ends.shape[1], end - t, 0)


def step_slots(
    masks: torch.Tensor,
    attention_mask: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
    fetch: list | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, Segments | None]:
    """masks [K, B, T] bool -> ([(rows, slots)] of each step's True slots, counts [K], the packed
    rows' `Segments` or None), with one host sync for all K steps, the documents (their sizes) and
    the right-padding check; `nonzero_static` then needs none. `fetch`: [tensor, ...] more 1-d integer
    tensors to bring to the host in the same sync, replaced in place by their values (lists); under
    context parallelism the masks are a rank's slots and the documents those of the whole rows
    (attention_mask's length).

    Raises ValueError for rows that are not right-padded (the causal attention would read their
    leading padding)."""
    K, B, T = masks.shape
    T = attention_mask.shape[1]
    counts = masks.flatten(1).sum(1)  # [K] on the device
    if is_fake(
        counts
    ):  # `spec plan` runs the step on fake tensors: no data, so every slot with a target counts
        if seq_lens is not None:
            raise ValueError("packed rows have no plan: their documents are data")
        rows, slots = _every_slot(K, B, masks.shape[2], masks.device)
        for i, x in enumerate(
            fetch or []
        ):  # (the group's counts: this rank's, as good as any for memory)
            fetch[i] = [max(int(r.numel()), 1) for r in rows][: x.numel()]
        return list(zip(rows, slots)), counts, None
    left_padded = (attention_mask[:, 1:] > attention_mask[:, :-1]).any().long().reshape(1)
    more = [x.long().reshape(-1) for x in (fetch or [])]
    host = [counts, left_padded, *more] + ([] if seq_lens is None else [seq_lens.long().flatten()])
    sizes = torch.cat(
        host
    ).tolist()  # the one sync: index sets and documents have data-dependent sizes
    sizes, bad, rest = sizes[:K], sizes[K], sizes[K + 1 :]
    for i, x in enumerate(more):
        fetch[i], rest = rest[: x.numel()], rest[x.numel() :]
    lengths = rest
    if bad:
        raise ValueError("attention_mask must be right-padded (ones, then zeros)")
    local = masks.shape[2]
    flat = torch.nonzero_static(masks.reshape(-1), size=sum(sizes)).squeeze(
        1
    )  # sorted by (k, b, t)
    rows, slots = (flat // local) % B, flat % local
    segments = None
    if seq_lens is not None:
        D = seq_lens.shape[1]
        segments = Segments.from_lengths([lengths[b * D : (b + 1) * D] for b in range(B)], T)
    return list(zip(rows.split(sizes), slots.split(sizes))), counts, segments


def _every_slot(K: int, B: int, T: int, device) -> tuple[list, list]:
    """Each step's (rows, slots) when every slot with a target counts (step k: t + k before the row's
    last token, which has nothing to predict): the memory's upper bound."""
    rows, slots = [], []
    for k in range(K):
        n = max(T - 1 - k, 0)
        flat = torch.arange(B * n, device=device)
        rows.append(flat // n if n else flat)
        slots.append(flat % n if n else flat)
    return rows, slots


def packed_positions(seq_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, D] document lengths -> [B, T] positions restarting at 0 in each document."""
    starts = seq_lens.long().cumsum(1) - seq_lens.long()  # [B, D]
    doc = document_index(seq_lens, seq_len).clamp_max(seq_lens.shape[1] - 1)
    return torch.arange(seq_len, device=seq_lens.device) - starts.gather(1, doc)


def positions(batch: TargetBatch) -> torch.Tensor:
    """[B, T] each slot's position: the batch's own, per document when packed, else 0..T-1."""
    if batch.position_ids is not None:
        return batch.position_ids
    B, T = (
        batch.attention_mask.shape
    )  # (whole rows, also in a batch read for one context-parallel rank)
    if batch.seq_lens is not None:
        return packed_positions(batch.seq_lens, T)
    return torch.arange(T, device=batch.input_ids.device).expand(B, T)


def unroll(
    draft,
    batch: TargetBatch,
    state: torch.Tensor,
    head: Callable,
    supervised: torch.Tensor,
    ttt_steps: int,
    step_weight: float,
    checkpoint: bool = False,
    shard=None,
    inputs: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """Run `ttt_steps` steps of `draft` (rope, ttt_step, decoder_layers) from `state` [B, T, H] (what
    the draft reads at step 0); `supervised` [B, T] marks the slots that carry a loss at step 0 (rolled
    with the step). checkpoint: recompute each step's decoder layers and head in backward (a head with a
    true `recomputes` attribute does its own, e.g. losses.chunked_soft_ce).

    shard (spec_cli/draft/context.py ContextShard): context parallelism. `batch` holds the whole rows,
    `state` this rank's slots of them [B, 2c, H]; the draft runs on those slots only, its attention over
    the whole rows' keys, and each step's loss is this rank's share of the mean over the whole rows'
    supervised slots (the shares of the group add up to the single-process loss, as the metrics' sums
    do). The head is called with a seventh argument, the scored slots' indices in the rows.

    inputs: what the slots read besides the state, [B, T] or [B, T, H] (MSD: the target's input embeddings),
    rolled with the step as the ids are; default the batch's input_ids."""
    B, T = (
        batch.attention_mask.shape
    )  # (whole rows: under context parallelism the other fields may not be)
    if shard is None:
        own = lambda x: x  # noqa: E731
        ahead = shift_left  # slot t's value k slots on: x[:, t + k]
    else:  # this rank's slots, from whole rows or from the ranges read for it
        own, ahead = shard.owned, lambda x, k: shard.local(x, k)  # noqa: E731
    position_ids = own(positions(batch))
    remaining = own(doc_remaining(batch.attention_mask, batch.seq_lens))  # [B, T]
    # slot t takes part at step k while the target at t + k is still in t's document
    valid = torch.stack([remaining > k for k in range(ttt_steps)])  # [K, B, T]
    scored = valid & torch.stack([ahead(batch.loss_mask, k).bool() for k in range(ttt_steps)])
    sup = valid & torch.stack([ahead(supervised, k).bool() for k in range(ttt_steps)])
    # bias: None is causal (right-padded keys come after every real query); packed rows are causal
    # within each document, one kernel call each
    fetch = [] if shard is None else [shard.all_reduce(sup.flatten(1).sum(1))]  # the group's counts
    slots, counted, bias = step_slots(sup, batch.attention_mask, batch.seq_lens, fetch)
    share = [1.0] * ttt_steps
    if shard is not None:
        from spec_cli.draft.context import ContextBias, whole_rows

        local = [int(r.numel()) for r, _ in slots]
        share = [
            n / max(g, 1) for n, g in zip(local, fetch[0])
        ]  # this rank's part of each step's mean
        bias = ContextBias(shard, bias if bias is not None else whole_rows(B, T))
    weights = step_weights(ttt_steps, step_weight)
    score = head
    if checkpoint and not getattr(head, "recomputes", False):
        score = lambda *a: activation_checkpoint(head, *a, use_reentrant=False)  # noqa: E731

    caches = [[] for _ in draft.decoder_layers]
    total_loss = state.new_zeros((), dtype=torch.float32)
    losses, correct = [], []
    for k in range(ttt_steps):
        ids = ahead(batch.input_ids if inputs is None else inputs, k)  # slot t reads token t + k
        cos, sin = draft.rope(position_ids + k)  # [B, T, d], at position t + k (serving's)
        state = draft.ttt_step(ids, state, cos, sin, caches, bias, checkpoint)  # [B, T, H]
        sup_b, sup_t = slots[k]
        if shard is None:
            value, hits = score(draft, state, batch, sup_b, sup_t, k)
        else:
            value, hits = score(
                draft, state, batch, sup_b, sup_t, k, shard.in_batch(sup_t.device)[sup_t]
            )
            value = value * share[k]
        total_loss = total_loss + weights[k] * value
        losses.append(value.detach())
        correct.append(hits)
    return ObjectiveOutput(
        loss=total_loss,
        step_loss=torch.stack(losses),
        correct=torch.stack(correct),
        total=scored.flatten(1).sum(1),
        supervised=counted,
    )
