"""TTT attention against a slow explicit computation: keys = [step-0 causal prefix] + [own position
from steps 1..k], a plain softmax over them. Outputs and gradients must match (GQA, packing, dtypes)."""

import math

import pytest
import torch

from spec_cli.draft import attention
from spec_cli.draft.attention import (
    Segments,
    block_causal_bias,
    document_index,
    pick_kernel,
    ttt_attention,
)
from tests.draft import break_fused_kernel, one_thread  # noqa: F401 (autouse fixture)


def explicit_attention(q, k0, v0, extra_k, extra_v, allowed):
    """allowed [B, T, T] bool over step-0 keys. Loops over queries; builds each key list."""
    B, h, T, d = q.shape
    group = h // k0.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for head in range(h):
            kv = head // group
            for t in range(T):
                keys = [k0[b, kv, s] for s in range(T) if allowed[b, t, s]]
                values = [v0[b, kv, s] for s in range(T) if allowed[b, t, s]]
                keys += [kj[b, kv, t] for kj in extra_k]
                values += [vj[b, kv, t] for vj in extra_v]
                scores = torch.stack([q[b, head, t] @ key for key in keys]) / math.sqrt(d)
                out[b, head, t] = scores.softmax(0) @ torch.stack(values)
    return out


def _inputs(B, h, kv, T, d, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    return (
        rand(B, h, T, d),
        rand(B, kv, T, d),
        rand(B, kv, T, d),
        [rand(B, kv, T, d) for _ in range(n)],
        [rand(B, kv, T, d) for _ in range(n)],
    )


def _allowed(B, T, seq_lens):
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if seq_lens is None:
        return causal.expand(B, T, T)
    allowed = torch.zeros(B, T, T, dtype=torch.bool)
    for b, docs in enumerate(seq_lens.tolist()):
        start = 0
        for n in docs + [T - sum(docs)]:  # trailing padding is its own block
            allowed[b, start : start + n, start : start + n] = causal[:n, :n]
            start += n
    return allowed


CASES = [  # heads, kv heads, extra steps, packing (None: causal rows)
    (4, 2, 0, None),
    (4, 2, 1, None),
    (4, 1, 6, None),
    (2, 2, 3, "bias"),
    (4, 2, 6, "bias"),
    (2, 2, 3, "segments"),
    (4, 2, 6, "segments"),
    (4, 1, 0, "segments"),
]


@pytest.mark.parametrize("impl", ["fused", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads,kv_heads,n_extra,packed", CASES)
def test_matches_explicit(impl, dtype, heads, kv_heads, n_extra, packed, monkeypatch):
    monkeypatch.setattr(attention, "MATH_CHUNK", 5)  # several chunks on tiny T
    B, T, d = 2, 11, 8
    seq_lens = torch.tensor([[4, 5], [11, 0]]) if packed else None
    q, k0, v0, ek, ev = _inputs(B, heads, kv_heads, T, d, n_extra, dtype)
    bias = None
    if packed == "bias":
        bias = block_causal_bias(seq_lens, T, dtype)
    elif packed == "segments":
        bias = Segments.from_seq_lens(seq_lens, T)
    out = ttt_attention(q, k0, v0, ek, ev, bias, impl=impl)
    ref = explicit_attention(q, k0, v0, ek, ev, _allowed(B, T, seq_lens))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(out, ref, **tol)

    dout = torch.randn_like(out)
    inputs = [q, k0, v0, *ek, *ev]
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **tol)


WINDOW_CASES = [  # heads, kv heads, extra steps, packing, window
    (4, 2, 0, None, 3),
    (4, 2, 2, None, 4),
    (4, 1, 6, "segments", 3),
    (2, 2, 3, "segments", 5),  # the 4-token document fits in it, the 5- and 11-token ones do not
    (4, 2, 2, "bias", 4),
    (2, 2, 1, None, 11),  # no restriction: the window reaches over the whole row
]


@pytest.mark.parametrize("impl", ["fused", "math"])
@pytest.mark.parametrize("heads,kv_heads,n_extra,packed,window", WINDOW_CASES)
def test_sliding_window_matches_explicit(
    impl, heads, kv_heads, n_extra, packed, window, monkeypatch
):
    """--draft-window: query t attends keys t - window + 1 .. t of its document (plus its own extra
    keys), forward and backward exact, whatever the kernel calls are cut into (chunks of 2 rows here,
    so the chunks' key ranges overlap and their key gradients add up)."""
    monkeypatch.setattr(attention, "MATH_CHUNK", 5)
    monkeypatch.setattr(attention, "WINDOW_CHUNK", 2)
    B, T, d, dtype = 2, 11, 8, torch.float64
    seq_lens = torch.tensor([[4, 5], [11, 0]]) if packed else None
    q, k0, v0, ek, ev = _inputs(B, heads, kv_heads, T, d, n_extra, dtype, seed=3)
    bias = None
    if packed == "bias":
        bias = block_causal_bias(seq_lens, T, dtype)
    elif packed == "segments":
        bias = Segments.from_seq_lens(seq_lens, T)
    windowed = attention.with_window(bias, window, B, T)
    out = ttt_attention(q, k0, v0, ek, ev, windowed, impl=impl)
    t = torch.arange(T)
    near = t[None, :] > t[:, None] - window  # [T, T] keys inside each query's window
    ref = explicit_attention(q, k0, v0, ek, ev, _allowed(B, T, seq_lens) & near)
    tol = dict(atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(out, ref, **tol)
    if window < T:  # the window changed something (else the case checks that nothing changed)
        assert not torch.allclose(out, ttt_attention(q, k0, v0, ek, ev, bias, impl=impl))
    dout = torch.randn_like(out)
    inputs = [q, k0, v0, *ek, *ev]
    for g, r in zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(ref, inputs, dout)):
        torch.testing.assert_close(g, r, **tol)


def test_sliding_window_pieces_skip_varlen_only_where_it_binds():
    """Documents no longer than the window keep the one-call path (varlen on CUDA); a longer one is
    cut into chunks whose biases hold causality and the window."""
    segments = attention.with_window(
        Segments.from_lengths([[4, 4], [3, 0]], 8), 5, 2, 8
    )  # padding 3..8
    assert not segments.window_binds and segments.window == 5
    like = torch.zeros(1)
    assert [p[:4] for p in attention._pieces(segments, like)] == [
        (0, 0, 4, 0),
        (0, 4, 8, 4),
        (1, 0, 3, 0),
        (1, 3, 8, 3),
    ]
    longer = attention.with_window(Segments.from_lengths([[9]], 9), 3, 1, 9)
    assert longer.window_binds
    pieces = list(attention._pieces(longer, like))
    assert [p[:4] for p in pieces] == [(0, 0, 9, 0)]  # WINDOW_CHUNK (256) rows per call
    bias = attention.window_bias(3, 5, 3, torch.float32, "cpu")  # queries 2..4 of keys 0..4
    assert torch.equal(
        bias[0, 0] == 0, torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]).bool()
    )
    assert bias.stride(2) == 16  # padded storage: the CUDA kernels' alignment
    assert (
        attention.with_window(None, 9, 1, 9) is None
    )  # a window over the whole row changes nothing


def test_bfloat16_runs_close_to_fp32():
    q, k0, v0, ek, ev = _inputs(1, 4, 2, 9, 8, 2, torch.float32)
    ref = ttt_attention(q, k0, v0, ek, ev)
    low = ttt_attention(
        *(x.bfloat16() for x in (q, k0, v0)), [x.bfloat16() for x in ek], [x.bfloat16() for x in ev]
    )
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)


def test_kernel_choice_by_device_and_dtype():
    assert pick_kernel(torch.device("cpu"), torch.float32).name == "cpu_flash"
    assert pick_kernel(torch.device("cpu"), torch.float32, "math").name == "math"
    assert attention.fused_kernel(torch.device("meta"), torch.float32) is None
    assert pick_kernel(torch.device("meta"), torch.float32).name == "math"
    with pytest.raises(ValueError):
        pick_kernel(torch.device("meta"), torch.float32, "fused")


def test_broken_fused_kernel_falls_back_to_math(monkeypatch):
    """A fused kernel that disagrees with the math kernel is never used (the CUDA path's guard)."""
    break_fused_kernel(monkeypatch)
    with pytest.warns(UserWarning, match="self-check"):
        assert pick_kernel(torch.device("cpu"), torch.float32).name == "math"


def test_segments_cover_every_slot_once():
    seq_lens = torch.tensor([[2, 3, 0], [1, 0, 0], [4, 2, 0]])
    assert Segments.from_seq_lens(seq_lens, 6).spans == (
        (0, 0, 2),
        (0, 2, 5),
        (0, 5, 6),
        (1, 0, 1),
        (1, 1, 6),
        (2, 0, 4),
        (2, 4, 6),
    )


def test_document_index_and_bias():
    seq_lens = torch.tensor([[2, 3, 0], [1, 0, 0]])
    assert document_index(seq_lens, 6).tolist() == [[0, 0, 1, 1, 1, 3], [0, 3, 3, 3, 3, 3]]
    bias = block_causal_bias(seq_lens, 6, torch.float32)
    assert bias.shape == (2, 1, 6, 6)
    assert torch.equal(bias[:, 0] == 0, _allowed(2, 6, seq_lens))


def test_memory_is_linear_in_length():
    """No [T, T] tensor is saved for backward: saved bytes grow linearly with T."""

    def saved_bytes(T):
        q, k0, v0, ek, ev = _inputs(1, 4, 2, T, 8, 3, torch.float32)
        seen = {}

        def pack(x):
            seen[x.data_ptr()] = x.numel() * x.element_size()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            ttt_attention(q, k0, v0, ek, ev)
        return sum(seen.values())

    small, large = saved_bytes(256), saved_bytes(1024)
    assert large <= 4.5 * small


@pytest.mark.parametrize("packed", [False, True])
def test_cuda_kernel_plumbing_on_meta_tensors(packed):
    """The CUDA efficient-attention path cannot run here (no GPU); this checks its argument plumbing
    and shapes (lse padding, GQA repeat and group sums, bias) with meta tensors. Numerics on a GPU are
    guarded by the self-check against the math kernel before first use."""
    B, h, kv, T, d = 2, 4, 2, 19, 16
    q = torch.randn(B, h, T, d, device="meta", requires_grad=True)
    k0, v0, k1, v1 = (torch.randn(B, kv, T, d, device="meta", requires_grad=True) for _ in range(4))
    bias = None
    if packed:
        bias = torch.zeros(B, 1, T, 32, device="meta")[..., :T]
    out = attention._TTTAttention.apply(
        attention.CUDA_EFFICIENT, bias, d**-0.5, 1, q, k0, v0, k1, v1
    )
    assert out.shape == (B, h, T, d)
    grads = torch.autograd.grad(out, [q, k0, v0, k1, v1], torch.ones_like(out))
    assert [g.shape for g in grads] == [q.shape] + [k0.shape] * 4


def test_cuda_kernel_takes_windowed_calls_on_meta_tensors(monkeypatch):
    """Under a binding --draft-window the CUDA efficient kernel gets chunks of queries against longer key
    ranges, with a rectangular bias (broadcast to [B, h, queries, keys], last dim stored padded)."""
    monkeypatch.setattr(attention, "WINDOW_CHUNK", 8)
    seen = []
    real = torch.ops.aten._scaled_dot_product_efficient_attention

    def recording(q, k, v, bias, *rest, **kwargs):
        seen.append((q.shape[2], k.shape[2], None if bias is None else tuple(bias.shape)))
        return real(q, k, v, bias, *rest, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", recording)
    B, h, kv, T, d = 1, 4, 2, 19, 16
    q = torch.randn(B, h, T, d, device="meta", requires_grad=True)
    k0, v0, k1, v1 = (torch.randn(B, kv, T, d, device="meta", requires_grad=True) for _ in range(4))
    windowed = attention.with_window(None, 6, B, T)
    out = attention._TTTAttention.apply(
        attention.CUDA_EFFICIENT, windowed, d**-0.5, 1, q, k0, v0, k1, v1
    )
    grads = torch.autograd.grad(out, [q, k0, v0, k1, v1], torch.ones_like(out))
    assert [g.shape for g in grads] == [q.shape] + [k0.shape] * 4
    assert seen == [(8, 8, (1, 4, 8, 8)), (8, 13, (1, 4, 8, 13)), (3, 8, (1, 4, 3, 8))]


@pytest.mark.parametrize("packed", [False, True])
def test_cuda_backward_reads_out_in_the_forwards_layout(packed, monkeypatch):
    """The efficient kernel's backward reads `out` (and `dout`) laid out as its forward wrote it,
    [B, T, h, d] in memory. Given a [B, h, T, d]-contiguous `out` it returned garbage dq and dk in bf16
    and fp16 (errors of 1e37 and NaN, no exception; fp32 was right), measured on an H200 with torch
    2.11: the self-check then turned the fused kernel off and training ran at half speed. Checked
    here on the meta device by the strides the op receives."""
    seen = []
    real = torch.ops.aten._scaled_dot_product_efficient_attention_backward

    def recording(dout, q, k, v, bias, out, *rest, **kwargs):
        seen.append((dout.stride(), out.stride(), out.shape))
        return real(dout, q, k, v, bias, out, *rest, **kwargs)

    monkeypatch.setattr(
        torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", recording
    )
    B, h, kv, T, d = 2, 4, 2, 19, 16
    q = torch.randn(B, h, T, d, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k0, v0 = (
        torch.randn(B, kv, T, d, device="meta", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    bias = (
        torch.zeros(B, 1, T, 32, device="meta", dtype=torch.bfloat16)[..., :T] if packed else None
    )
    out = attention._TTTAttention.apply(attention.CUDA_EFFICIENT, bias, d**-0.5, 0, q, k0, v0)
    torch.autograd.grad(out, [q, k0, v0], torch.ones_like(out))
    assert seen
    bthd = (
        torch.empty(B, T, h, d, device="meta").transpose(1, 2).stride()
    )  # the forward's own layout
    for dout_stride, out_stride, shape in seen:
        assert shape == (B, h, T, d)
        assert out_stride == bthd and dout_stride == bthd


def test_under_bf16_autocast_the_attention_gets_one_dtype_and_keeps_the_fused_kernel(monkeypatch):
    """The GPU path's autocast, on CPU: q and k come out of rope in the projections' bf16 like v (fp32
    rope tables used to make them fp32), and the fused kernel's self-check, run outside autocast at
    bf16's tolerance, passes: no fallback to the math kernel."""
    import warnings

    from spec_cli.draft import attention
    from spec_cli.draft.eagle3.ttt import ttt_forward
    from tests.draft import random_batch, tiny_draft

    if attention.fused_kernel(torch.device("cpu"), torch.bfloat16) is None:
        pytest.skip("no fused CPU kernel for bf16 in this torch")
    monkeypatch.setattr(attention, "_checked", {})  # check afresh, under autocast
    seen = []
    real = attention.pick_kernel

    def pick(device, dtype, impl="auto"):
        kernel = real(device, dtype, impl)
        seen.append((dtype, kernel.name))
        return kernel

    calls = []
    apply = attention._TTTAttention.apply

    def recording(kernel, bias, scale, n, *tensors):
        calls.append({t.dtype for t in tensors})
        return apply(kernel, bias, scale, n, *tensors)

    monkeypatch.setattr(attention, "pick_kernel", pick)
    monkeypatch.setattr(attention._TTTAttention, "apply", recording)
    draft = tiny_draft()
    batch = random_batch(draft.config, [13, 9], 13)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a self-check failure warns: make it fail the test
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttt_forward(draft, batch, ttt_steps=3)
        out.loss.backward()
    assert calls and all(dtypes == {torch.bfloat16} for dtypes in calls)
    assert {name for _, name in seen} == {
        attention.fused_kernel(torch.device("cpu"), torch.bfloat16).name
    }
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in draft.parameters())


VARLEN_KINDS = [
    ("flash", "heads_total", 1),
    ("flash", "per_document", 1),
    ("efficient", "per_document", 32),
]


@pytest.mark.parametrize("kind,lse_layout,pad_to", VARLEN_KINDS)
@pytest.mark.parametrize("heads,kv_heads,n_extra", [(4, 2, 0), (4, 2, 3), (2, 1, 6)])
def test_packed_rows_in_one_varlen_call_match_explicit(
    kind, lse_layout, pad_to, heads, kv_heads, n_extra, monkeypatch
):
    """Packed rows on CUDA go to one varlen kernel call per batch, forward and backward, whatever the
    number of documents (the per-document loop was ~60 calls per row and TTT step). The CUDA ops are
    stood in by CPU implementations of their contracts (tests/draft/varlen_ops.py): this tests the
    packing (flattening, offsets, both lse layouts, the merged lse given back to the backward, GQA)
    against the explicit computation."""
    from tests.draft.varlen_ops import install

    ops = install(monkeypatch, kind, lse_layout, pad_to)
    B, T, d = 2, 21, 8
    seq_lens = torch.tensor([[5, 1, 9, 3], [21, 0, 0, 0]])
    q, k0, v0, ek, ev = _inputs(B, heads, kv_heads, T, d, n_extra, torch.float64, seed=3)
    segments = Segments.from_seq_lens(seq_lens, T)
    out = ttt_attention(q, k0, v0, ek, ev, bias=segments)
    ops.calls.update(fwd=0, bwd=0)  # after the self-check's calls
    out = ttt_attention(q, k0, v0, ek, ev, bias=segments)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad(out, [q, k0, v0, *ek, *ev], dout)
    assert ops.calls == {"fwd": 1, "bwd": 1}

    ref_in = [x.detach().clone().requires_grad_() for x in (q, k0, v0, *ek, *ev)]
    rq, rk, rv, rek, rev = (
        ref_in[0],
        ref_in[1],
        ref_in[2],
        ref_in[3 : 3 + n_extra],
        ref_in[3 + n_extra :],
    )
    ref = explicit_attention(rq, rk, rv, rek, rev, _allowed(B, T, seq_lens))
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_varlen_self_check_failure_falls_back_to_one_call_per_document(monkeypatch):
    """A varlen op that gets the layout wrong is turned down by its self-check, with a warning; packed
    rows then run once per document and stay right."""
    from tests.draft.varlen_ops import install

    ops = install(monkeypatch, "flash", "heads_total")
    real = ops.flash_fwd

    def shuffled(*args, **kwargs):  # the lse of the wrong slots: what a layout mix-up looks like
        out, lse, *rest = real(*args, **kwargs)
        return (out, lse.flip(-1), *rest)

    monkeypatch.setitem(attention.VARLEN_OPS, "flash", (shuffled, ops.flash_bwd))
    B, T, d = 1, 12, 8
    seq_lens = torch.tensor([[4, 8]])
    q, k0, v0, ek, ev = _inputs(B, 2, 2, T, d, 2, torch.float64)
    with pytest.warns(
        UserWarning, match="flash_varlen .* failed its self-check.*one kernel call per document"
    ):
        out = ttt_attention(q, k0, v0, ek, ev, bias=Segments.from_seq_lens(seq_lens, T))
    assert (
        attention.packed_kernel_name(attention.CPU_FLASH, q.device, q.dtype)
        == "cpu_flash per document"
    )
    ref = explicit_attention(q, k0, v0, ek, ev, _allowed(B, T, seq_lens))
    torch.testing.assert_close(out, ref)


def test_varlen_offsets_reach_the_device_in_one_non_blocking_copy(monkeypatch):
    """The documents' offsets are made from host ints once per batch and copied in one go (pinned and
    non-blocking on CUDA, where a pageable copy waits for the GPU's queue): counted on CPU by the
    copies `_varlen_plan` makes, whatever the number of layers and TTT steps that use them."""
    copies = []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        copies.append(kwargs.get("non_blocking", False))
        return real_to(self, *args, **kwargs)

    segments = Segments.from_lengths([[3, 4], [7, 0]], 7)
    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    plans = [attention._varlen_plan(segments, torch.device("cpu")) for _ in range(5)]
    monkeypatch.undo()
    assert copies == [True]
    plan = plans[0]
    assert all(p is plan for p in plans)
    assert plan.cu_seqlens.dtype == torch.int32 and plan.cu_seqlens.tolist() == [0, 3, 7, 14]
    assert plan.max_len == 7
    assert plan.seq.tolist() == [0] * 3 + [1] * 4 + [2] * 7
    assert plan.local.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]


def test_flash_varlen_plumbing_on_meta_tensors():
    """The real aten flash varlen ops on meta tensors (torch's own shape rules for them): arguments
    in the schema's order, the lse in flash's [h, total] layout read back to [B, h, T], gradients in
    the inputs' shapes (GQA native). The efficient op's meta rule lacks its `out` argument in this
    torch, so only its CPU stand-in covers it; on a GPU both are self-checked before first use."""
    B, h, kv, T, d = 2, 4, 2, 19, 16
    segments = Segments.from_lengths([[7, 12], [19, 0]], T)
    q = torch.randn(B, h, T, d, device="meta", dtype=torch.bfloat16)
    k, v = (torch.randn(B, kv, T, d, device="meta", dtype=torch.bfloat16) for _ in range(2))
    out, lse, state = attention.FLASH_VARLEN.fwd(q, k, v, segments, d**-0.5)
    assert out.shape == q.shape and lse.shape == (B, h, T) and lse.dtype == torch.float32
    assert state[2] == (
        (h, B * T),
        torch.float32,
    )  # the kernel's lse layout, kept for the backward (not the tensor)
    grads = attention.FLASH_VARLEN.bwd(q, q, k, v, segments, out, lse, d**-0.5, state)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
