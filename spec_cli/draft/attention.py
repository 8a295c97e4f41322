"""TTT attention: step-0 causal attention plus each position's own keys from later TTT steps.

At TTT step k (SpecForge's `cache_hidden` recurrence, docs/eagle.md "TTT unroll"), query t attends to

    keys = [k0[s] for s <= t in t's document]  +  [k1[t], k2[t], ..., kk[t]]

The causal part runs in a fused attention kernel that also returns its log-sum-exp (lse); the k extra
keys are per-position dot products; the two softmaxes merge exactly:

    s_j = q . k_j[t] * scale                                 # [B, h, T] for each extra step j
    lse = logaddexp(lse_c, logsumexp_j s_j)                  # the global normaliser
    out = exp(lse_c - lse) * out_c + sum_j exp(s_j - lse) * v_j[t]

Backward is exact too: flash attention's backward only needs the softmax probabilities
P = exp(s - lse) and D = rowsum(dO * O). Run with the MERGED out and lse, the fused backward returns
the exact gradient of the causal keys (the split-KV identity); the extra keys get theirs explicitly:

    dS_j = P_j * (dO . v_j - D);  dq += dS_j * k_j * scale;  dk_j = dS_j * q * scale;  dv_j = P_j * dO

No [T, T] score tensor is ever materialised, so memory grows linearly with T. Packed rows pass their
documents as `Segments` (block-causal is causal within each document: exact, and sum(L_i^2) instead
of T^2). On CUDA every document of the batch goes to ONE varlen kernel call (cu_seqlens), forward
and backward; elsewhere, or when the varlen call fails its self-check, the kernel runs once per
document (on a CPU that loop is as fast as anything: the work is the same and launches are free). A
dense [B, 1, T, T] bias (`block_causal_bias`) is still accepted for callers that have one.
Kernels (chosen by device and dtype at run time):
- "cpu_flash": aten._scaled_dot_product_flash_attention_for_cpu (+ its backward), GQA native.
- "cuda_efficient": aten._scaled_dot_product_efficient_attention (+ its backward); packed rows via
  aten._flash_attention_forward's varlen form in 16-bit (GQA native) and
  aten._efficient_attention_forward's in fp32. The CUDA calls cannot run in this repo's tests (no
  GPU): their packing is tested with CPU stand-ins of the two ops, and each is checked against the
  math kernel on a tiny input before first use and replaced (varlen by the per-document loop, the
  kernel by the math kernel), with a warning, if it fails or disagrees.
- "math": query-chunked plain PyTorch with the same (out, lse) contract; any device or dtype.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# ---------------------------------------------------------------------------------------------
# masks


def block_causal_bias(seq_lens: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias for packed rows: causal within each document, -inf across.

    seq_lens: [B, D] document lengths (zero-padded); slots past their sum form one more block.
    Returns [B, 1, T, T] (0 = attend, -inf = masked). Its last dim is stored padded to a multiple of
    16 elements, which the CUDA kernels require and the CPU kernel accepts.
    """
    doc = document_index(seq_lens, seq_len)  # [B, T]
    same_doc = doc[:, :, None] == doc[:, None, :]  # [B, T, T]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc.device).tril()
    padded = -(-seq_len // 16) * 16
    bias = torch.zeros(doc.shape[0], 1, seq_len, padded, dtype=dtype, device=doc.device)
    bias = bias[..., :seq_len]
    bias.masked_fill_(~(same_doc & causal)[:, None], float("-inf"))
    return bias


def document_index(seq_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, D] document lengths -> [B, T] index of each slot's document (D for trailing padding)."""
    ends = seq_lens.long().cumsum(1)  # [B, D] exclusive end of each document
    slots = torch.arange(seq_len, device=seq_lens.device).expand(seq_lens.shape[0], seq_len)
    return torch.searchsorted(ends, slots.contiguous(), right=True)


@dataclass(frozen=True)
class Segments:
    """The documents of packed rows as (row, start, end) slot ranges, together covering every slot of
    every row (a row's trailing padding is one more range). Attention is causal within a range and
    never crosses one."""

    spans: tuple[tuple[int, int, int], ...]
    _plans: dict = field(default_factory=dict, compare=False, repr=False)  # varlen plans by device
    # a sliding window: query t attends keys t - window + 1 .. t of its range (None: all of them)
    window: int | None = None

    @property
    def window_binds(self) -> bool:
        """Whether the window leaves some query without a key of its range (a longer range exists)."""
        return self.window is not None and any(e - s > self.window for _, s, e in self.spans)

    @classmethod
    def from_seq_lens(cls, seq_lens: torch.Tensor, seq_len: int) -> Segments:
        """From [B, D] document lengths (one host sync: use `from_lengths` with host values)."""
        return cls.from_lengths(seq_lens.tolist(), seq_len)

    @classmethod
    def from_lengths(cls, rows: list[list[int]], seq_len: int) -> Segments:
        """From each row's document lengths (host ints, zero-padded)."""
        spans = []
        for row, lengths in enumerate(rows):
            start = 0
            for length in lengths:
                if length > 0:
                    spans.append((row, start, start + length))
                    start += length
            if start < seq_len:
                spans.append((row, start, seq_len))
        return cls(tuple(spans))


WINDOW_CHUNK = 256  # query rows per kernel call of a windowed range (at least the window)


def _pieces(segments: Segments, like: torch.Tensor):
    """The kernel calls of `segments`: (row, query start, query end, key start, bias). A range no longer
    than the window is one causal call (bias None); a longer one is cut into query chunks of
    max(window, WINDOW_CHUNK) rows, each against the keys its window reaches, with an additive bias
    holding causality and the window (keys s with q - window < s <= q)."""
    window = segments.window
    for b, s, e in segments.spans:
        if window is None or e - s <= window:
            yield b, s, e, s, None
            continue
        for qs, qe, ks in window_chunks(s, s, e, window):
            yield b, qs, qe, ks, window_bias(qe - qs, qe - ks, window, like.dtype, like.device)


def window_chunks(start: int, qs: int, qe: int, window: int):
    """Queries qs .. qe - 1 of a document starting at `start`, under a sliding window, as kernel calls of
    max(window, WINDOW_CHUNK) queries: (query start, query end, key start), the keys running from the
    first one the chunk's window reaches to its last query."""
    chunk = max(window, WINDOW_CHUNK)
    for a in range(qs, qe, chunk):
        yield a, min(a + chunk, qe), max(start, a - window + 1)


def window_bias(n_q: int, n_k: int, window: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, n_q, n_k] additive bias for the last n_q queries against the last n_k keys (n_k >= n_q, the
    queries are the keys' last n_q): 0 where q - window < key <= q, -inf elsewhere. Stored with its last
    dim padded to a multiple of 16 (the CUDA kernels' alignment)."""
    rows = torch.arange(n_k - n_q, n_k, device=device)[:, None]  # each query's index among the keys
    cols = torch.arange(n_k, device=device)[None, :]
    far = (cols > rows) | (cols <= rows - window)
    padded = -(-n_k // 16) * 16
    bias = torch.zeros(1, 1, n_q, padded, dtype=dtype, device=device)[..., :n_k]
    return bias.masked_fill_(far, float("-inf"))


def _segmented_fwd(kernel, q, k, v, segments: Segments, scale):
    """The causal kernel once per segment (per chunk of a segment under a binding window); (out, lse,
    per-call states)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=_acc_dtype(q.dtype), device=q.device)
    states = []
    for b, qs, qe, ks, bias in _pieces(segments, q):
        o, l, state = kernel.fwd(
            q[b : b + 1, :, qs:qe].contiguous(),
            k[b : b + 1, :, ks:qe].contiguous(),
            v[b : b + 1, :, ks:qe].contiguous(),
            bias,
            scale,
        )
        out[b : b + 1, :, qs:qe] = o
        lse[b : b + 1, :, qs:qe] = l
        states.append(state)
    return out, lse, states


def _segmented_bwd(kernel, dout, q, k, v, segments: Segments, out, lse, scale, states):
    """Each call's backward with the merged out and lse (exact: the split-KV identity); under a binding
    window the chunks' key ranges overlap, so their key gradients add up."""
    overlap = segments.window_binds
    dq = torch.empty_like(q)
    acc = _acc_dtype(q.dtype)  # overlapping chunks' key gradients add up: in fp32, cast once
    dk, dv = (
        (
            torch.zeros(k.shape, dtype=acc, device=k.device),
            torch.zeros(v.shape, dtype=acc, device=v.device),
        )
        if overlap
        else (torch.empty_like(k), torch.empty_like(v))
    )
    for (b, qs, qe, ks, bias), state in zip(_pieces(segments, q), states):

        def rows(x):
            return x[b : b + 1, :, qs:qe].contiguous()

        gq, gk, gv = kernel.bwd(
            rows(dout),
            rows(q),
            k[b : b + 1, :, ks:qe].contiguous(),
            v[b : b + 1, :, ks:qe].contiguous(),
            bias,
            rows(out),
            lse[b : b + 1, :, qs:qe].contiguous(),
            scale,
            state,
        )
        dq[b : b + 1, :, qs:qe] = gq
        if overlap:
            dk[b : b + 1, :, ks:qe] += gk
            dv[b : b + 1, :, ks:qe] += gv
        else:
            dk[b : b + 1, :, ks:qe], dv[b : b + 1, :, ks:qe] = gk, gv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def with_window(bias, window: int | None, B: int, T: int):
    """The attention structure `bias` (None: causal rows; Segments: packed documents; a dense additive
    [B, 1, T, T] bias) restricted to a sliding window: query t attends keys t - window + 1 .. t only.
    A window that reaches back over every row is no restriction: `bias` comes back as it was."""
    if hasattr(bias, "windowed"):  # a context-parallel shard: its rows are longer than T
        return bias if window is None else bias.windowed(window)
    if window is None or window >= T:
        return bias
    if window < 1:
        raise ValueError(f"a sliding window needs at least 1 key, got {window}")
    if bias is None:
        bias = Segments.from_lengths([[T]] * B, T)
    if isinstance(bias, Segments):
        return dataclasses.replace(bias, window=window)  # (its varlen plans are the spans': shared)
    t = torch.arange(T, device=bias.device)
    return bias.masked_fill((t[None, :] <= t[:, None] - window), float("-inf"))


def _causal_fwd(kernel, q, k, v, bias, scale):
    if hasattr(bias, "causal_fwd"):  # a context-parallel shard's rows (spec_cli/draft/context.py)
        return bias.causal_fwd(kernel, q, k, v, scale)
    if isinstance(bias, Segments):
        # (a binding window goes per range: the varlen calls here take no window)
        varlen = None if bias.window_binds else _varlen_of(kernel, q.device, q.dtype)
        if varlen is not None:
            return varlen.fwd(q, k, v, bias, scale)
        return _segmented_fwd(kernel, q, k, v, bias, scale)
    return kernel.fwd(q, k, v, bias, scale)


def _causal_bwd(kernel, dout, q, k, v, bias, out, lse, scale, state):
    if hasattr(bias, "causal_bwd"):
        return bias.causal_bwd(kernel, dout, q, k, v, out, lse, scale, state)
    if isinstance(bias, Segments):
        varlen = None if bias.window_binds else _varlen_of(kernel, q.device, q.dtype)
        if varlen is not None:
            return varlen.bwd(dout, q, k, v, bias, out, lse, scale, state)
        return _segmented_bwd(kernel, dout, q, k, v, bias, out, lse, scale, state)
    return kernel.bwd(dout, q, k, v, bias, out, lse, scale, state)


# ---------------------------------------------------------------------------------------------
# varlen: all the documents of a packed batch in one kernel call. The rows' slots, flattened to
# [B * T], are the documents back to back (Segments cover every slot, in order), so q [B, h, T, d]
# becomes [B * T, h, d] and cu_seqlens are the cumulative document lengths.


@dataclass(frozen=True)
class _VarlenPlan:
    cu_seqlens: torch.Tensor  # [S + 1] int32, on the device
    max_len: int  # the longest document (host int: the kernels size their grids by it)
    seq: torch.Tensor  # [B * T] each slot's document (for a per-document lse layout)
    local: torch.Tensor  # [B * T] each slot's position in its document


def _varlen_plan(segments: Segments, device: torch.device) -> _VarlenPlan:
    """The documents' offsets on `device`, made once per batch from host ints: one copy, from pinned
    memory and non-blocking on CUDA (a pageable copy would wait for the GPU's queue)."""
    plan = segments._plans.get(device)
    if plan is None:
        lengths = [end - start for _, start, end in segments.spans]
        total = sum(lengths)
        seq = [i for i, length in enumerate(lengths) for _ in range(length)]
        local = [j for length in lengths for j in range(length)]
        host = torch.tensor([0, *itertools.accumulate(lengths), *seq, *local])
        if device.type == "cuda":
            host = host.pin_memory()
        on_device = host.to(device, non_blocking=True)
        cu, seq, local = on_device.split([len(lengths) + 1, total, total])
        plan = _VarlenPlan(cu.int(), max(lengths), seq, local)
        segments._plans[device] = plan
    return plan


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, h, T, d] -> [B * T, h, d], contiguous (the varlen kernels' layout; a plain reshape may
    return a strided view, e.g. of the merged TTT output)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous()


def _unflat(x: torch.Tensor, B: int) -> torch.Tensor:
    """[B * T, h, d] -> [B, h, T, d] (a view)."""
    return x.unflatten(0, (B, -1)).transpose(1, 2)


def _lse_from_kernel(lse: torch.Tensor, plan: _VarlenPlan, B: int) -> torch.Tensor:
    """A varlen kernel's lse -> [B, h, T] float32. Kernels lay it out [h, B * T] (flash-attention
    2.5 and later) or per document [S, h, >= max_len] (the efficient kernel, older flash)."""
    if lse.dim() == 2:
        flat = lse  # [h, B * T]
    else:
        flat = lse[plan.seq, :, plan.local].transpose(0, 1)  # [h, B * T]
    return flat.to(_acc_dtype(lse.dtype)).unflatten(1, (B, -1)).transpose(0, 1).contiguous()


def _lse_to_kernel(lse: torch.Tensor, plan: _VarlenPlan, like: tuple) -> torch.Tensor:
    """[B, h, T] -> the layout `like` = (shape, dtype) of the kernel's own lse from the forward (only its
    layout is kept until backward, not the tensor: the merged lse replaces it)."""
    shape, dtype = like
    flat = lse.transpose(0, 1).reshape(lse.shape[1], -1).to(dtype)  # [h, B * T]
    if len(shape) == 2:
        return flat.contiguous()
    out = torch.zeros(shape, dtype=dtype, device=lse.device)
    out[plan.seq, :, plan.local] = flat.transpose(0, 1)
    return out


# the raw ops (aten names, or callables: tests put CPU stand-ins of the CUDA ops here)
VARLEN_OPS = {
    "flash": ("_flash_attention_forward", "_flash_attention_backward"),
    "efficient": ("_efficient_attention_forward", "_efficient_attention_backward"),
}


def _op(op):
    return op if callable(op) else getattr(torch.ops.aten, op)


def _flash_varlen_fwd(q, k, v, segments: Segments, scale):
    """16-bit, GQA native: q [B*T, h, d], k/v [B*T, hkv, d]."""
    B = q.shape[0]
    plan = _varlen_plan(segments, q.device)
    fwd, _ = VARLEN_OPS["flash"]
    out, lse, rng, unused, _ = _op(fwd)(
        _flat(q),
        _flat(k),
        _flat(v),
        plan.cu_seqlens,
        plan.cu_seqlens,
        plan.max_len,
        plan.max_len,
        0.0,
        True,
        False,
        scale=scale,
    )
    return (
        _unflat(out, B),
        _lse_from_kernel(lse, plan, B),
        (rng, unused, (tuple(lse.shape), lse.dtype)),
    )


def _flash_varlen_bwd(dout, q, k, v, segments: Segments, out, lse, scale, state):
    B = q.shape[0]
    plan = _varlen_plan(segments, q.device)
    rng, unused, kernel_lse = state
    _, bwd = VARLEN_OPS["flash"]
    dq, dk, dv = _op(bwd)(
        _flat(dout),
        _flat(q),
        _flat(k),
        _flat(v),
        _flat(out),
        _lse_to_kernel(lse, plan, kernel_lse),
        plan.cu_seqlens,
        plan.cu_seqlens,
        plan.max_len,
        plan.max_len,
        0.0,
        True,
        rng,
        unused,
        scale=scale,
    )
    return _unflat(dq, B), _unflat(dk, B), _unflat(dv, B)


_CAUSAL_FROM_TOP_LEFT = 1  # the efficient kernel's custom_mask_type for causal


def _efficient_varlen_fwd(q, k, v, segments: Segments, scale):
    """Any CUDA dtype; no GQA (kv heads repeated): q/k/v [1, B*T, h, d]."""
    B, h = q.shape[0], q.shape[1]
    plan = _varlen_plan(segments, q.device)
    fwd, _ = VARLEN_OPS["efficient"]
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    out, lse, seed, offset, _, _ = _op(fwd)(
        _flat(q)[None],
        _flat(k)[None],
        _flat(v)[None],
        None,
        plan.cu_seqlens,
        plan.cu_seqlens,
        plan.max_len,
        plan.max_len,
        0.0,
        _CAUSAL_FROM_TOP_LEFT,
        True,
        scale=scale,
    )
    return (
        _unflat(out[0], B),
        _lse_from_kernel(lse, plan, B),
        (seed, offset, (tuple(lse.shape), lse.dtype)),
    )


def _efficient_varlen_bwd(dout, q, k, v, segments: Segments, out, lse, scale, state):
    B, h, kv_heads = q.shape[0], q.shape[1], k.shape[1]
    plan = _varlen_plan(segments, q.device)
    seed, offset, kernel_lse = state
    _, bwd = VARLEN_OPS["efficient"]
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    dq, dk, dv, _ = _op(bwd)(
        _flat(dout)[None],
        _flat(q)[None],
        _flat(k)[None],
        _flat(v)[None],
        None,
        _flat(out)[None],
        plan.cu_seqlens,
        plan.cu_seqlens,
        plan.max_len,
        plan.max_len,
        _lse_to_kernel(lse, plan, kernel_lse),
        0.0,
        seed,
        offset,
        _CAUSAL_FROM_TOP_LEFT,
        False,
        scale=scale,
    )
    return (
        _unflat(dq[0], B),
        _sum_groups(_unflat(dk[0], B), kv_heads),
        _sum_groups(_unflat(dv[0], B), kv_heads),
    )


# ---------------------------------------------------------------------------------------------
# causal kernels: fwd(q, k, v, bias, scale) -> (out, lse, state); bwd(dout, q, k, v, bias, out, lse,
# scale, state) -> (dq, dk, dv). q [B, h, T, d]; k, v [B, hkv, T, d]; bias None (causal) or an
# additive [B, 1, T, T] bias that already contains the causal structure. lse [B, h, T] float32
# (float64 for float64 inputs).


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Full:
    """A kernel call's `bias` meaning every key is attended (no mask, not causal): a context-parallel
    shard's queries against keys that all come before them."""

    def __repr__(self) -> str:
        return "FULL"


FULL = _Full()


def _mask(bias) -> tuple[torch.Tensor | None, bool]:
    """A kernel call's bias -> (additive mask or None, is_causal): None is causal, FULL neither."""
    if bias is FULL:
        return None, False
    return bias, bias is None


def _cpu_flash_fwd(q, k, v, bias, scale):
    mask, causal = _mask(bias)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    return out, lse, None


def _cpu_flash_bwd(dout, q, k, v, bias, out, lse, scale, state):
    mask, causal = _mask(bias)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, h, T, d] -> [B, hkv, T, d], summing each kv head's query group."""
    return x if x.shape[1] == kv_heads else x.unflatten(1, (kv_heads, -1)).sum(2)


def _cuda_efficient_fwd(q, k, v, bias, scale):
    B, h, T, _ = q.shape
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    bias, causal = _mask(bias)
    bias = (
        None if bias is None else bias.expand(B, h, T, k.shape[2])
    )  # (windowed calls: more keys than queries)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., :T], (seed, offset, lse.shape[-1])  # lse comes padded to a multiple of 32


def _cuda_efficient_bwd(dout, q, k, v, bias, out, lse, scale, state):
    seed, offset, lse_len = state
    B, h, T, _ = q.shape
    kv_heads = k.shape[1]
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    bias, causal = _mask(bias)
    bias = None if bias is None else bias.expand(B, h, T, k.shape[2])
    lse = torch.nn.functional.pad(lse.float(), (0, lse_len - T))
    # the kernel reads `out` (and `dout`) in the layout its forward wrote: [B, T, h, d] in memory. In
    # 16-bit, an `out` laid out [B, h, T, d] gives garbage dq and dk on a GPU (an H200), no error
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _bthd(dout),
        q,
        k,
        v,
        bias,
        _bthd(out),
        lse,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)


def _bthd(x: torch.Tensor) -> torch.Tensor:
    """[B, h, T, d] as a view of [B, T, h, d] memory (the efficient kernel's own output layout)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


MATH_CHUNK = 256  # query rows per chunk of the math kernel: its memory is O(chunk * T)


def _chunk_bias(bias, start, end, like):
    """Additive bias for query rows [start, end) against keys [0, end + the keys before the first query)."""
    if bias is FULL:
        return 0.0
    if bias is not None:
        return bias[:, :, start:end, : end + bias.shape[-1] - bias.shape[-2]]
    rows = torch.arange(start, end, device=like.device)[:, None]
    cols = torch.arange(end, device=like.device)[None, :]
    return torch.zeros(end - start, end, dtype=like.dtype, device=like.device).masked_fill_(
        cols > rows, float("-inf")
    )


def _math_fwd(q, k, v, bias, scale):
    acc = _acc_dtype(q.dtype)
    T, h = q.shape[2], q.shape[1]
    k, v = _repeat_kv(k, h).to(acc), _repeat_kv(v, h).to(acc)
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    for start in range(0, T, MATH_CHUNK):
        stop = min(start + MATH_CHUNK, T)
        end = _keys_end(bias, stop, T, k.shape[2])
        s = q[:, :, start:stop].to(acc) @ k[:, :, :end].transpose(-1, -2) * scale  # [B, h, c, end]
        s = s + _chunk_bias(bias, start, stop, s)
        lse[:, :, start:stop] = s.logsumexp(-1)
        out[:, :, start:stop] = torch.exp(s - lse[:, :, start:stop, None]) @ v[:, :, :end]
    return out.to(q.dtype), lse, None


def _keys_end(bias, stop: int, T: int, keys: int) -> int:
    """The keys a chunk of query rows ending at `stop` can attend: all of them under FULL, else causally
    up to its last row (the queries are the keys' last T: a windowed call has keys before them)."""
    return keys if bias is FULL else stop + keys - T


def _math_bwd(dout, q, k, v, bias, out, lse, scale, state):
    acc = _acc_dtype(q.dtype)
    T, h, kv_heads = q.shape[2], q.shape[1], k.shape[1]
    k, v = _repeat_kv(k, h).to(acc), _repeat_kv(v, h).to(acc)
    dout, out = dout.to(acc), out.to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    D = (dout * out).sum(-1, keepdim=True)  # [B, h, T, 1] rowsum(dO * O)
    for start in range(0, T, MATH_CHUNK):
        stop = min(start + MATH_CHUNK, T)
        end = _keys_end(bias, stop, T, k.shape[2])
        qc, doc = q[:, :, start:stop].to(acc), dout[:, :, start:stop]
        s = qc @ k[:, :, :end].transpose(-1, -2) * scale + _chunk_bias(bias, start, stop, qc)
        p = torch.exp(s - lse[:, :, start:stop, None])  # [B, h, c, end] global probabilities
        dv[:, :, :end] += p.transpose(-1, -2) @ doc
        ds = p * (doc @ v[:, :, :end].transpose(-1, -2) - D[:, :, start:stop])
        dq[:, :, start:stop] = ds @ k[:, :, :end] * scale
        dk[:, :, :end] += ds.transpose(-1, -2) @ qc * scale
    return (
        dq.to(q.dtype),
        _sum_groups(dk, kv_heads).to(q.dtype),
        _sum_groups(dv, kv_heads).to(q.dtype),
    )


@dataclass(frozen=True)
class Kernel:
    name: str
    fwd: Callable
    bwd: Callable


FLASH_VARLEN = Kernel("flash_varlen", _flash_varlen_fwd, _flash_varlen_bwd)  # fwd/bwd take Segments
EFFICIENT_VARLEN = Kernel("efficient_varlen", _efficient_varlen_fwd, _efficient_varlen_bwd)
CPU_FLASH = Kernel("cpu_flash", _cpu_flash_fwd, _cpu_flash_bwd)
CUDA_EFFICIENT = Kernel("cuda_efficient", _cuda_efficient_fwd, _cuda_efficient_bwd)
MATH = Kernel("math", _math_fwd, _math_bwd)

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_checked: dict[tuple, bool] = {}
_failures: dict[tuple, str] = {}  # why a kernel failed its self-check, by the same key


def fused_kernel(device: torch.device, dtype: torch.dtype) -> Kernel | None:
    """The fused kernel for this device and dtype, or None."""
    if device.type == "cpu" and dtype in _CPU_DTYPES:
        return CPU_FLASH
    if device.type == "cuda" and dtype in _CUDA_DTYPES:
        return CUDA_EFFICIENT
    return None


def varlen_kernel(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> Kernel | None:
    """The one-call-per-batch kernel for packed rows that goes with `kernel`, or None (the CPU: the
    per-document loop is as fast there)."""
    if kernel is not CUDA_EFFICIENT or device.type != "cuda":
        return None
    return FLASH_VARLEN if dtype in (torch.bfloat16, torch.float16) else EFFICIENT_VARLEN


def _varlen_of(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> Kernel | None:
    """varlen_kernel, once it has passed its self-check on this device and dtype."""
    varlen = varlen_kernel(kernel, device, dtype)
    if varlen is None or not _self_check(varlen, device, dtype):
        return None
    return varlen


def packed_kernel_name(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> str:
    """What packed rows run on with `kernel` (self-checked now): the varlen kernel's name, or
    "<kernel> per document"."""
    varlen = _varlen_of(kernel, device, dtype)
    return varlen.name if varlen is not None else f"{kernel.name} per document"


def pick_kernel(device: torch.device, dtype: torch.dtype, impl: str = "auto") -> Kernel:
    """impl: "auto" (fused when available and self-checked, else math), "fused" or "math"."""
    if impl == "math":
        return MATH
    kernel = fused_kernel(device, dtype)
    if impl == "fused":
        if kernel is None:
            raise ValueError(f"no fused attention kernel for {device.type}/{dtype}")
        return kernel
    if impl != "auto":
        raise ValueError(f"unknown attention impl {impl!r}: use auto, fused or math")
    if kernel is None or not _self_check(kernel, device, dtype):
        return MATH
    return kernel


def _self_check(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once on a tiny input (GQA, causal and masked) against the math kernel."""
    key = _key(kernel, device, dtype)
    if key not in _checked:
        _checked[key] = _agrees_with_math(kernel, device, dtype)
    return _checked[key]


def choose(
    device: torch.device, dtype: torch.dtype, impl: str = "auto"
) -> tuple[Kernel, str | None]:
    """The kernel a training run will use for activations of `dtype` on `device` (--attention `impl`),
    self-checked now rather than at the first step, and why the fused kernel is not used (None when it
    is, or when `impl` is "math"). "fused" raises ConfigError when it cannot be used: a run that asked
    for it should not train at half speed with O(T^2) memory instead."""
    from spec_cli.errors import ConfigError

    if impl not in ("auto", "fused", "math"):
        raise ConfigError(f"unknown --attention {impl!r}", "use auto, fused or math")
    if impl == "math":
        return MATH, None
    kernel = fused_kernel(device, dtype)
    if kernel is None:
        why = f"there is no fused TTT attention kernel for {device.type}/{str(dtype).replace('torch.', '')}"
    elif not _self_check(kernel, device, dtype):
        why = (
            f"the fused TTT attention kernel {kernel.name} failed its self-check on {device.type}/"
            f"{str(dtype).replace('torch.', '')} ({_failures.get(_key(kernel, device, dtype), 'see the warning above')})"
        )
    else:
        return kernel, None
    if impl == "fused":
        raise ConfigError(
            f"--attention fused: {why}",
            "use --attention auto to train with the math kernel instead (slower; memory O(T^2))",
        )
    return MATH, why


def _key(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> tuple:
    return (kernel.name, device.type, device.index, dtype)


@torch.no_grad()
def _agrees_with_math(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    B, h, kv_heads, T, d = 2, 4, 2, 19, 16

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v, dout = (
        rand(B, h, T, d),
        rand(B, kv_heads, T, d),
        rand(B, kv_heads, T, d),
        rand(B, h, T, d),
    )
    seq_lens = torch.tensor([[7, 12], [19, 0]], device=device)
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    varlen = kernel in (FLASH_VARLEN, EFFICIENT_VARLEN)
    try:
        with torch.autocast(
            device.type, enabled=False
        ):  # the kernels at `dtype`, whatever the caller runs
            if varlen:
                _compare_varlen_to_math(kernel, q, k, v, dout, seq_lens, T, dtype, d, tol)
            else:
                _compare_to_math(kernel, q, k, v, dout, seq_lens, T, dtype, d, tol)
    except Exception as err:  # noqa: BLE001 - any failure means: do not use this kernel
        _failures[_key(kernel, device, dtype)] = str(err)
        instead = "one kernel call per document" if varlen else "the slower math kernel"
        warnings.warn(
            f"fused TTT attention kernel {kernel.name} on {device.type}/{dtype} failed its "
            f"self-check ({err}); using {instead}"
        )
        return False
    return True


def _agree(pairs, tol: float) -> None:
    if not all(torch.allclose(a.double(), b.double(), atol=tol, rtol=tol) for a, b in pairs):
        raise RuntimeError("results differ from the math kernel")


def _compare_to_math(
    kernel: Kernel, q, k, v, dout, seq_lens, T: int, dtype: torch.dtype, d: int, tol: float
) -> None:
    """Raise when `kernel`'s forward or backward differs from the math kernel's beyond `tol`: causal rows,
    packed documents, and the calls a sliding window and context parallelism make (the last queries of
    more keys under a window's bias; queries against keys all before them, unmasked)."""
    cases = [
        (slice(None), slice(None), None),
        (slice(None), slice(None), block_causal_bias(seq_lens, T, dtype)),
        (slice(11, T), slice(5, T), window_bias(T - 11, T - 5, 6, dtype, q.device)),
        (slice(12, T), slice(0, 9), FULL),
    ]
    for rows, keys, bias in cases:
        q_, dout_, k_, v_ = q[:, :, rows], dout[:, :, rows], k[:, :, keys], v[:, :, keys]
        out, lse, state = kernel.fwd(q_, k_, v_, bias, d**-0.5)
        ref_out, ref_lse, _ = MATH.fwd(q_, k_, v_, bias, d**-0.5)
        grads = kernel.bwd(dout_, q_, k_, v_, bias, ref_out, ref_lse, d**-0.5, state)
        ref_grads = MATH.bwd(dout_, q_, k_, v_, bias, ref_out, ref_lse, d**-0.5, None)
        _agree([(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)], tol)


def _compare_varlen_to_math(
    kernel: Kernel, q, k, v, dout, seq_lens, T: int, dtype: torch.dtype, d: int, tol: float
) -> None:
    """As _compare_to_math for a varlen kernel: documents of 7 and 12 slots, a whole row, and a
    row of one document and its padding; the backward is given another (out, lse) than its forward
    made, as the TTT merge does."""
    for lengths in ([[7, 12], [19, 0]], [[1, 16], [5, 0]]):
        segments = Segments.from_lengths(lengths, T)
        bias = block_causal_bias(torch.tensor(lengths, device=q.device), T, dtype)
        out, lse, state = kernel.fwd(q, k, v, segments, d**-0.5)
        ref_out, ref_lse, _ = MATH.fwd(q, k, v, bias, d**-0.5)
        grads = kernel.bwd(
            dout, q, k, v, segments, ref_out.clone(), ref_lse.clone(), d**-0.5, state
        )
        ref_grads = MATH.bwd(dout, q, k, v, bias, ref_out, ref_lse, d**-0.5, None)
        _agree([(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)], tol)


# ---------------------------------------------------------------------------------------------
# the TTT attention


def _extra_scores(q: torch.Tensor, extra_k: list[torch.Tensor], scale: float) -> torch.Tensor:
    """q [B, h, T, d], extra_k[j] [B, hkv, T, d] -> [B, h, T, n]: each query against its own position."""
    qg = q.unflatten(1, (extra_k[0].shape[1], -1))  # [B, hkv, g, T, d]
    return torch.stack([(qg * kj[:, :, None]).sum(-1).flatten(1, 2) for kj in extra_k], -1) * scale


def _extra_values(p: torch.Tensor, extra_v: list[torch.Tensor]) -> torch.Tensor:
    """p [B, h, T, n], extra_v[j] [B, hkv, T, d] -> sum_j p_j * v_j: [B, h, T, d]."""
    kv_heads = extra_v[0].shape[1]
    pg = p.unflatten(1, (kv_heads, -1))  # [B, hkv, g, T, n]
    return sum(pg[..., j, None] * vj[:, :, None] for j, vj in enumerate(extra_v)).flatten(1, 2)


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, bias, scale, n_extra, q, k0, v0, *extra):
        acc = _acc_dtype(q.dtype)
        out_c, lse_c, state = _causal_fwd(kernel, q, k0, v0, bias, scale)  # [B, h, T, d], [B, h, T]
        lse_c = lse_c.to(acc)
        if n_extra == 0:
            out, lse = out_c, lse_c
        else:
            extra_k = [x.to(acc) for x in extra[:n_extra]]
            extra_v = [x.to(acc) for x in extra[n_extra:]]
            s = _extra_scores(q.to(acc), extra_k, scale)  # [B, h, T, n]
            lse = torch.logaddexp(lse_c, s.logsumexp(-1))  # [B, h, T] global normaliser
            out = (
                torch.exp(lse_c - lse)[..., None] * out_c.to(acc)
                + _extra_values(torch.exp(s - lse[..., None]), extra_v)
            ).to(q.dtype)
        ctx.kernel, ctx.scale, ctx.n_extra, ctx.state = kernel, scale, n_extra, state
        ctx.segments = (
            None if bias is None or isinstance(bias, torch.Tensor) else bias
        )  # (a structure, not a tensor)
        ctx.save_for_backward(None if ctx.segments else bias, out, lse, q, k0, v0, *extra)
        return out

    @staticmethod
    def backward(ctx, dout):
        bias, out, lse, q, k0, v0, *extra = ctx.saved_tensors
        bias = ctx.segments or bias
        n, scale = ctx.n_extra, ctx.scale
        # causal part: the fused backward with the merged out and lse is exact (split-KV identity)
        dq, dk0, dv0 = _causal_bwd(ctx.kernel, dout, q, k0, v0, bias, out, lse, scale, ctx.state)
        if n == 0:
            return None, None, None, None, dq, dk0, dv0
        acc = lse.dtype
        extra_k = [x.to(acc) for x in extra[:n]]
        extra_v = [x.to(acc) for x in extra[n:]]
        q_, dout_ = q.to(acc), dout.to(acc)
        kv_heads = k0.shape[1]
        p = torch.exp(_extra_scores(q_, extra_k, scale) - lse[..., None])  # [B, h, T, n]
        D = (dout_ * out.to(acc)).sum(-1)  # [B, h, T] rowsum(dO * O)
        dq = dq.to(acc)
        dks, dvs = [], []
        for j in range(n):
            kj = _repeat_kv(extra_k[j], q.shape[1])
            vj = _repeat_kv(extra_v[j], q.shape[1])
            ds = p[..., j] * ((dout_ * vj).sum(-1) - D)  # [B, h, T]
            dq = dq + ds[..., None] * kj * scale
            dks.append(_sum_groups(ds[..., None] * q_ * scale, kv_heads).to(extra[j].dtype))
            dvs.append(_sum_groups(p[..., j, None] * dout_, kv_heads).to(extra[n + j].dtype))
        return (None, None, None, None, dq.to(q.dtype), dk0, dv0, *dks, *dvs)


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    extra_k: list[torch.Tensor] = (),
    extra_v: list[torch.Tensor] = (),
    bias: torch.Tensor | Segments | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention of TTT step n = len(extra_k): causal over (k0, v0), plus each query's own position
    in every extra (k_j, v_j).

    q: [B, h, T, d]; k0, v0, extra_k[j], extra_v[j]: [B, hkv, T, d] (hkv divides h);
    bias: None for causal (right padding needs nothing more: padded keys sit after every real query),
    packed documents as `Segments` (causal within each), or an additive [B, 1, T, T] bias holding the
    block-causal structure (`block_causal_bias`). Returns [B, h, T, d].
    """
    if len(extra_k) != len(extra_v):
        raise ValueError("extra_k and extra_v must have the same length")
    kernel = pick_kernel(q.device, q.dtype, impl)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(bias, torch.Tensor):
        bias = bias.to(q.dtype)
    if hasattr(
        bias, "whole_rows"
    ):  # a context-parallel shard: the causal part reads whole rows' keys
        k0, v0 = bias.whole_rows(k0), bias.whole_rows(v0)
        bias = (
            bias.without_rows()
        )  # (the graph keeps this copy: the gathered rows must not be in it)
    return _TTTAttention.apply(kernel, bias, scale, len(extra_k), q, k0, v0, *extra_k, *extra_v)
