"""CPU stand-ins of the two CUDA varlen attention ops (aten._flash_attention_forward/_backward with
cu_seqlens, aten._efficient_attention_forward/_backward with cu_seqlens), written from their
contracts: inputs flattened to [total, h, d] ([1, total, h, d] for the efficient op), int32
cumulative document lengths, causal within each document, and the log-sum-exp either [h, total]
(flash-attention >= 2.5) or per document [S, h, padded max length] (the efficient op, older flash).
Each document runs on the CPU's own attention. They check what the CUDA ops require of their
inputs (dtype of the offsets, contiguity, the lse given back in the forward's layout) and count
their calls, so that tests can hold packed rows to one call per batch."""

from __future__ import annotations

import torch

CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class VarlenOps:
    def __init__(self, lse_layout: str = "heads_total", pad_to: int = 1):
        assert lse_layout in ("heads_total", "per_document")
        self.lse_layout, self.pad_to = lse_layout, pad_to
        self.calls = {"fwd": 0, "bwd": 0}

    # -- helpers ------------------------------------------------------------------------------
    def _docs(self, cu: torch.Tensor, max_len: int) -> list[tuple[int, int]]:
        assert cu.dtype == torch.int32, "cu_seqlens must be int32"
        bounds = cu.tolist()
        docs = list(zip(bounds[:-1], bounds[1:]))
        assert max_len == max(e - s for s, e in docs), "max_seqlen must be the longest document"
        return docs

    def _lse_shape(self, h: int, total: int, docs, max_len: int):
        if self.lse_layout == "heads_total":
            return (h, total)
        return (len(docs), h, -(-max_len // self.pad_to) * self.pad_to)

    @staticmethod
    def _doc(x: torch.Tensor, s: int, e: int, heads: int | None = None) -> torch.Tensor:
        """[total, hx, d] slice -> [1, h, L, d] (kv heads repeated to `heads` when given)."""
        part = x[s:e].transpose(0, 1)[None]
        if heads is not None and part.shape[1] != heads:
            part = part.repeat_interleave(heads // part.shape[1], dim=1)
        return part.contiguous()

    def _forward(self, q, k, v, cu, max_len, scale):
        for x in (q, k, v):
            assert x.is_contiguous(), (
                f"varlen inputs must be contiguous [total, h, d]: {x.shape} {x.stride()}"
            )
        total, h, _ = q.shape
        docs = self._docs(cu, max_len)
        out = torch.empty_like(q)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # as the CPU op's lse
        lse = torch.zeros(self._lse_shape(h, total, docs, max_len), dtype=acc)
        for i, (s, e) in enumerate(docs):
            o, l = CPU_FWD(
                self._doc(q, s, e),
                self._doc(k, s, e, h),
                self._doc(v, s, e, h),
                0.0,
                True,
                scale=scale,
            )
            out[s:e] = o[0].transpose(0, 1)
            if self.lse_layout == "heads_total":
                lse[:, s:e] = l[0]
            else:
                lse[i, :, : e - s] = l[0]
        return out, lse, docs

    def _backward(self, dout, q, k, v, out, lse, cu, max_len, scale):
        for x in (dout, q, k, v, out):
            assert x.is_contiguous(), (
                f"varlen inputs must be contiguous [total, h, d]: {x.shape} {x.stride()}"
            )
        total, h, _ = q.shape
        docs = self._docs(cu, max_len)
        assert tuple(lse.shape) == self._lse_shape(h, total, docs, max_len), (
            "lse not in the forward's layout"
        )
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        groups = h // k.shape[1]
        for i, (s, e) in enumerate(docs):
            l = lse[:, s:e] if self.lse_layout == "heads_total" else lse[i, :, : e - s]
            gq, gk, gv = CPU_BWD(
                self._doc(dout, s, e),
                self._doc(q, s, e),
                self._doc(k, s, e, h),
                self._doc(v, s, e, h),
                self._doc(out, s, e),
                l[None].contiguous(),
                0.0,
                True,
                scale=scale,
            )
            dq[s:e] = gq[0].transpose(0, 1)
            dk[s:e] = gk[0].unflatten(0, (-1, groups)).sum(1).transpose(0, 1)
            dv[s:e] = gv[0].unflatten(0, (-1, groups)).sum(1).transpose(0, 1)
        return dq, dk, dv

    # -- the ops ------------------------------------------------------------------------------
    def flash_fwd(
        self,
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        return_debug_mask,
        *,
        scale=None,
    ):
        assert is_causal and dropout_p == 0.0 and cu_q is cu_k and max_q == max_k
        self.calls["fwd"] += 1
        out, lse, _ = self._forward(q, k, v, cu_q, max_q, scale)
        return out, lse, torch.zeros(2, dtype=torch.int64), torch.empty(0), torch.empty(0)

    def flash_bwd(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        rng,
        unused,
        *,
        scale=None,
    ):
        assert is_causal and dropout_p == 0.0
        self.calls["bwd"] += 1
        return self._backward(dout, q, k, v, out, lse, cu_q, max_q, scale)

    def efficient_fwd(
        self,
        q,
        k,
        v,
        bias,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        mask_type,
        lse_wanted,
        *,
        scale=None,
    ):
        assert bias is None and mask_type == 1 and lse_wanted and q.shape[0] == 1
        assert q.shape[2] == k.shape[2], "the efficient op has no GQA: repeat the kv heads"
        self.calls["fwd"] += 1
        out, lse, _ = self._forward(q[0], k[0], v[0], cu_q, max_q, scale)
        return out[None], lse, torch.tensor(0), torch.tensor(0), max_q, max_k

    def efficient_bwd(
        self,
        dout,
        q,
        k,
        v,
        bias,
        out,
        cu_q,
        cu_k,
        max_q,
        max_k,
        lse,
        dropout_p,
        seed,
        offset,
        mask_type,
        bias_requires_grad,
        *,
        scale=None,
    ):
        assert bias is None and mask_type == 1
        self.calls["bwd"] += 1
        dq, dk, dv = self._backward(dout[0], q[0], k[0], v[0], out[0], lse, cu_q, max_q, scale)
        return dq[None], dk[None], dv[None], torch.empty(0)


def install(
    monkeypatch, kind: str = "flash", lse_layout: str = "heads_total", pad_to: int = 1
) -> VarlenOps:
    """Route packed rows through the varlen kernel `kind` on the CPU, its ops stood in by VarlenOps."""
    from spec_cli.draft import attention

    ops = VarlenOps(lse_layout, pad_to)
    monkeypatch.setitem(
        attention.VARLEN_OPS, kind, (getattr(ops, f"{kind}_fwd"), getattr(ops, f"{kind}_bwd"))
    )
    chosen = attention.FLASH_VARLEN if kind == "flash" else attention.EFFICIENT_VARLEN
    monkeypatch.setattr(attention, "varlen_kernel", lambda kernel, device, dtype: chosen)
    monkeypatch.setattr(attention, "_checked", {})
    return ops
