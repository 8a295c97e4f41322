"""Context parallelism (CP): the slots of one batch of rows split over the N ranks of a CP group, so a
rank holds the draft's activations of T / N slots per row (docs/context-parallel.md).

Load balance. Causal attention's work grows with the query's index, so a rank given a contiguous quarter
of a row would do seven times the work of another. Each row is cut into 2N equal chunks and rank r holds
chunks r and 2N - 1 - r ("zig-zag"): every rank then does the same work, and its slots are two
contiguous runs (`ContextShard.owned`).

Attention. The draft's TTT attention needs, at every step, the step-0 keys and values of the whole row
(each slot's later-step keys are its own and stay local). They are small next to the activations (GQA:
hkv * d per slot, e.g. 1,024 values for Llama-3-8B against its 4,096-wide hidden state and 14,336-wide
MLP), so each rank all-gathers them once per layer and batch (the TTT steps all read the same step-0
keys: `ContextBias.whole_rows` keeps the gathered ones for the unroll), runs its own queries against
them with the same masks as a single process (causal by the slot's index in the row, documents,
sliding window) and, in backward, reduce-scatters their gradients (summed over the steps by autograd)
to the owners once, in fp32. This is the all-gather form of context parallelism (as in Llama 3's
training); kept for the unroll, it sends less than Ulysses all-to-all (queries and outputs re-sharded
at every step; heads divisible by N) and ring attention (the keys re-circulated at every step; its gain
is overlap on CUDA streams): bench/cp_attention.py, docs/context-parallel.md. Exact: each query's
softmax is merged from its kernel calls by their log-sum-exp, and backward runs the fused kernel with
the merged output (the split-KV identity).

Normalisation. Every masked mean of the objective is over the supervised slots of the whole batch: the
per-step counts are summed over the group (in the step's one host sync) and each rank's share of a
mean is its sum over that total, so the shares add up to the single-process value, as do the metrics'
sums.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spec_cli.batch import TargetBatch
from spec_cli.draft import attention
from spec_cli.draft.attention import Segments


@dataclass(frozen=True)
class Context:
    """This process's place in context parallelism: `size` ranks per group (consecutive global ranks),
    this one the group's `rank`-th. What the trainer gives the objective (Objective.context)."""

    size: int
    rank: int
    group: object = None
    alone: bool = False  # one process standing for a rank of the group (`spec plan`): LocalShard

    def shard(self, batch: TargetBatch, halo: int = 0) -> tuple[TargetBatch, ContextShard]:
        """The batch with its rows padded to a multiple of 2 * size slots, and this rank's shard of them.
        A batch read for this rank (batch.slots: kept_ranges(..., halo)) is taken as it is."""
        kind = LocalShard if self.alone else ContextShard
        if batch.slots is None:
            batch = pad_rows(batch, padded_length(batch.input_ids.shape[1], self.size))
            return batch, kind(self.size, self.rank, batch.input_ids.shape[1], self.group)
        T = batch.attention_mask.shape[1]
        ranges = kept_ranges(self.size, self.rank, T, halo)
        if batch.slots.numel() != sum(b - a for a, b in ranges):
            raise ValueError(
                f"the batch holds {batch.slots.numel()} slots of its rows; this rank needs the "
                f"ranges {ranges} (context parallel {self.size}, halo {halo})"
            )
        return batch, kind(self.size, self.rank, T, self.group, kept=tuple(ranges))


def padded_length(length: int, size: int) -> int:
    """A row's length padded to a multiple of 2 * size (context parallelism's chunks)."""
    return -(-length // (2 * size)) * 2 * size


def kept_ranges(size: int, rank: int, length: int, halo: int) -> list[tuple[int, int]]:
    """The slots of rows of `length` that rank `rank` of a group of `size` reads: its two chunks, each with
    the `halo` slots after it that the objective reads ahead (TTT step k reads slot t + k) and one more
    (the supervision at a slot is the target's at the next one)."""
    shard = ContextShard(size, rank, length)
    return [(a, min(b + halo + 1, length)) for a, b in shard.chunks()]


def pad_rows(batch: TargetBatch, length: int) -> TargetBatch:
    """Rows right-padded to `length` slots: padding everywhere (attention_mask, loss_mask, position_mask
    0; zeros elsewhere), which the objective neither attends to from a real slot nor scores."""
    extra = length - batch.input_ids.shape[1]
    if extra <= 0:
        return batch

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or t is batch.seq_lens:  # seq_lens [B, D] lists documents, not slots
            return t
        return torch.cat([t, t.new_zeros((t.shape[0], extra, *t.shape[2:]))], 1)

    return batch.map(pad)


@dataclass(frozen=True)
class ContextShard:
    """This rank's share of rows of `length` slots (a multiple of 2 * size) in a CP group of `size`."""

    size: int
    rank: int
    length: int
    group: object = None  # torch.distributed ProcessGroup (None: the default group)
    kept: tuple | None = (
        None  # the batch holds only these slot ranges of its rows (kept_ranges); None: all
    )
    _index: dict = field(default_factory=dict, compare=False, repr=False)  # by device

    def __post_init__(self):
        if self.length % (2 * self.size):
            raise ValueError(
                f"rows of {self.length} slots do not split into {2 * self.size} equal chunks"
            )

    @property
    def chunk(self) -> int:
        return self.length // (2 * self.size)

    def chunks(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two slot ranges of each row this rank holds, in its local order."""
        c, r = self.chunk, self.rank
        return (r * c, (r + 1) * c), ((2 * self.size - 1 - r) * c, (2 * self.size - r) * c)

    def owned(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """x's slots (along `dim`) that this rank holds, in its local order."""
        (a, b), (c, d) = self.chunks()
        return torch.cat([x.narrow(dim, a, b - a), x.narrow(dim, c, d - c)], dim)

    def index(self, device) -> torch.Tensor:
        """[2 * chunk] each local slot's index in the row (on `device`, made once)."""
        device = torch.device(device)
        kept = self._index.get(device)
        if kept is None:
            (a, b), (c, d) = self.chunks()
            kept = torch.cat([torch.arange(a, b, device=device), torch.arange(c, d, device=device)])
            self._index[device] = kept
        return kept

    def local(self, x: torch.Tensor, ahead: int = 0) -> torch.Tensor:
        """x's values at this rank's slots (`ahead` slots further on) from a batch field [B, stored, ...]:
        whole rows or the kept ranges (clamped at the end: a slot past its row's end is never scored)."""
        where = self.in_batch(x.device)
        if ahead:
            where = (where + ahead).clamp_max(x.shape[1] - 1)
        return x.index_select(1, where)

    def in_batch(self, device) -> torch.Tensor:
        """[2 * chunk] where each local slot sits in the batch's slots: its row index for whole rows, its
        place among the kept ranges for a batch read for this rank."""
        if self.kept is None:
            return self.index(device)
        device = torch.device(device)
        key = ("kept", device)
        kept = self._index.get(key)
        if kept is None:
            first = self.kept[0][1] - self.kept[0][0]
            kept = torch.cat(
                [
                    torch.arange(self.chunk, device=device),
                    first + torch.arange(self.chunk, device=device),
                ]
            )
            self._index[key] = kept
        return kept

    def _order(self) -> list[int]:
        """For each chunk of a row, in row order, its place in the rank-major layout all_gather makes."""
        n = self.size
        return [2 * i if i < n else 2 * (2 * n - 1 - i) + 1 for i in range(2 * n)]

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's slots of x (along `dim`) as whole rows, in row order."""
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((self.size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=self.group)
        chunks = out.unflatten(0, (2 * self.size, self.chunk))
        return chunks[self._order()].flatten(0, 1).movedim(0, dim)

    def scatter_sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Whole rows of x (along `dim`) summed over the group, each rank keeping its own slots."""
        rows = x.movedim(dim, 0).unflatten(0, (2 * self.size, self.chunk))
        inverse = [0] * (2 * self.size)
        for i, place in enumerate(self._order()):
            inverse[place] = i
        major = rows[inverse].flatten(0, 1).contiguous()
        out = major.new_empty((2 * self.chunk, *major.shape[1:]))
        dist.reduce_scatter_tensor(out, major, group=self.group)
        return out.movedim(0, dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def mean(self, total: torch.Tensor, count: int) -> torch.Tensor:
        """The group's mean of a quantity this rank has summed over `count` positions (no host wait)."""
        both = self.all_reduce(
            torch.stack([total.double(), total.new_tensor(count, dtype=torch.float64)])
        )
        return (both[0] / both[1].clamp_min(1)).to(total.dtype)


class LocalShard(ContextShard):
    """A rank's shard with the collectives replaced by local operations that make tensors of the same
    shapes (the other ranks' keys are this rank's, repeated): `spec plan` runs one rank's step on fake
    tensors with it, so the gathered keys and their gradients' buffers are counted as a rank holds them."""

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([x] * self.size, dim)

    def scatter_sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.movedim(dim, 0).contiguous()[: 2 * self.chunk].clone().movedim(0, dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class _GatherRows(torch.autograd.Function):
    """Whole rows of this rank's slots of x [B, hkv, 2c, d] (all-gather); backward, the rows' gradients
    (summed over every TTT step that read them) summed over the group into their owners, in fp32."""

    @staticmethod
    def forward(ctx, shard: ContextShard, x: torch.Tensor) -> torch.Tensor:
        ctx.shard = shard
        return shard.gather(x, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        wide = torch.promote_types(
            grad.dtype, torch.float32
        )  # bf16/fp16 -> fp32; fp32/fp64 as they are
        return None, ctx.shard.scatter_sum(grad.to(wide), 2).to(grad.dtype)


@dataclass(frozen=True)
class ContextBias:
    """The attention structure of a CP shard: whole rows' documents (`segments`, maybe windowed), whose
    queries this rank holds in part. `ttt_attention` takes it where it takes a Segments, and hands its
    causal part the whole rows' keys (`whole_rows`)."""

    shard: ContextShard
    segments: Segments
    gathered: dict = field(
        default_factory=dict, compare=False, repr=False
    )  # id(keys) -> (keys, rows)

    def whole_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The whole rows of this rank's keys or values x, gathered once per tensor: every TTT step of an
        unroll passes the same step-0 keys, so the later ones reuse the first step's gather (shared by
        the windowed copies of this bias, which `dataclasses.replace` hands the same dict)."""
        held = self.gathered.get(id(x))
        if held is not None and held[0] is x:
            return held[1]
        rows = _GatherRows.apply(self.shard, x)
        if torch._C._current_graph_task_id() == -1:  # not in backward: an activation checkpoint's
            self.gathered[id(x)] = (x, rows)  # recompute gathers its step-0 keys for itself, unkept
        return rows

    def without_rows(self) -> ContextBias:
        """This bias without the kept rows, for the attention's saved state: the rows' autograd history
        reaches back to the attention calls below, and a bias holding them there would be a reference
        cycle that keeps every step's gathered keys alive."""
        return dataclasses.replace(self, gathered={})

    def windowed(self, window: int) -> ContextBias:
        return dataclasses.replace(
            self,
            segments=attention.with_window(
                self.segments, window, len({s[0] for s in self.segments.spans}), self.shard.length
            ),
        )

    def pieces(self):
        """The kernel calls of this rank's queries: (row, local query start, global query start, query
        count, key start, key end, bias). Keys before a document's queries that the window does not cut are
        one unmasked call (attention.FULL), the queries' own range one causal call (bias None); under a
        window each chunk of queries gets its band of keys with an additive bias (attention.window_bias)."""
        window = self.segments.window
        for local, (cs, ce) in zip((0, self.shard.chunk), self.shard.chunks()):
            for b, s, e in self.segments.spans:
                qs, qe = max(cs, s), min(ce, e)
                if qs >= qe:
                    continue
                if window is None or qe - s <= window:
                    yield b, local + qs - cs, qs, qe - qs, qs, qe, None
                    if qs > s:
                        yield b, local + qs - cs, qs, qe - qs, s, qs, attention.FULL
                    continue
                for a, z, ks in attention.window_chunks(s, qs, qe, window):
                    yield b, local + a - cs, a, z - a, ks, z, "window"

    def causal_fwd(self, kernel, q, k, v, scale):
        """(out, lse, states) of this rank's queries q [B, h, 2c, d] against the row's keys: k, v are the
        whole rows' [B, hkv, T, d] (`whole_rows`)."""
        keys, values = k, v
        acc = attention._acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        states = []
        for b, lq, gq, n, ks, ke, bias in self.pieces():
            bias = self._bias(bias, n, ks, ke, q)
            o, l, state = kernel.fwd(
                q[b : b + 1, :, lq : lq + n].contiguous(),
                keys[b : b + 1, :, ks:ke].contiguous(),
                values[b : b + 1, :, ks:ke].contiguous(),
                bias,
                scale,
            )
            rows = (slice(b, b + 1), slice(None), slice(lq, lq + n))
            merged = torch.logaddexp(lse[rows], l.to(acc))
            out[rows] = (
                out[rows] * torch.exp(lse[rows] - merged)[..., None]
                + o.to(acc) * torch.exp(l.to(acc) - merged)[..., None]
            )
            lse[rows] = merged
            states.append(state)
        return out.to(q.dtype), lse, states

    def causal_bwd(self, kernel, dout, q, k, v, out, lse, scale, states):
        """dq, dk, dv of `causal_fwd`, given the merged out and lse: each call's backward (exact, the split-KV
        identity); dk, dv are the whole rows' (the gather's backward sums them into their owners)."""
        keys, values = k, v
        acc = attention._acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk, dv = (
            torch.zeros(keys.shape, dtype=acc, device=q.device),
            torch.zeros(values.shape, dtype=acc, device=q.device),
        )
        for (b, lq, gq, n, ks, ke, bias), state in zip(self.pieces(), states):
            bias = self._bias(bias, n, ks, ke, q)

            def rows(x):
                return x[b : b + 1, :, lq : lq + n].contiguous()

            gq_, gk, gv = kernel.bwd(
                rows(dout),
                rows(q),
                keys[b : b + 1, :, ks:ke].contiguous(),
                values[b : b + 1, :, ks:ke].contiguous(),
                bias,
                rows(out),
                lse[b : b + 1, :, lq : lq + n].contiguous(),
                scale,
                state,
            )
            dq[b : b + 1, :, lq : lq + n] += gq_.to(acc)
            dk[b : b + 1, :, ks:ke] += gk.to(acc)
            dv[b : b + 1, :, ks:ke] += gv.to(acc)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _bias(self, kind, n: int, ks: int, ke: int, like: torch.Tensor):
        if kind != "window":
            return kind
        return attention.window_bias(n, ke - ks, self.segments.window, like.dtype, like.device)


def whole_rows(rows: int, length: int) -> Segments:
    """Unpacked rows as documents: one range per row (causal over the row, as bias None is)."""
    return Segments.from_lengths([[length]] * rows, length)
