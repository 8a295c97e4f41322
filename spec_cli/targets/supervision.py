"""Supervision math (docs/eagle.md "Supervision: what the draft is trained to match"), shared by the
live backends and the feature-cache reader so they produce the same batches bit for bit.

Per token t (unshifted; the batch is shifted at the end):
- argmax_t, lse_t : over the FULL target vocab (chunked, never a full fp32 [N, V] tensor at once)
- sel_t           : the target's logits at the draft-vocab ids, [Vd]
- target_p_t      = softmax(sel_t)                       renormalised over the draft vocab
- target_mass_t   = exp(logsumexp(sel_t) - lse_t)        draft-vocab mass, full-vocab normaliser
- position_mask_t = t2d[argmax_t] & loss_mask_t
"""

from __future__ import annotations

import torch

from spec_cli.batch import TargetBatch
from spec_cli.targets.masks import document_ids

LOGITS_CHUNK_BYTES = 256 << 20  # fp32 logits held at once while scanning the full vocab (at most)
# On a CPU a chunk that stays in cache is faster (16 MB against 256 MB: bench/one_pass.py's cache
# step; figures in docs/results.md)
CPU_LOGITS_CHUNK_BYTES = 16 << 20


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma-2 style final logit soft-capping (identity when cap is None)."""
    return logits if not cap else torch.tanh(logits / cap) * cap


def full_vocab_stats(
    hidden: torch.Tensor,
    lm_head: torch.Tensor,
    bias: torch.Tensor | None = None,
    cap: float | None = None,
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [...] long, logsumexp [...] fp32) of hidden @ lm_head.T, a chunk of tokens at a time."""
    if chunk_bytes is None:
        chunk_bytes = CPU_LOGITS_CHUNK_BYTES if hidden.device.type == "cpu" else LOGITS_CHUNK_BYTES
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    vocab = lm_head.shape[0]
    chunk = max(1, chunk_bytes // (4 * vocab))
    argmax = torch.empty(flat.shape[0], dtype=torch.long, device=hidden.device)
    lse = torch.empty(flat.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.shape[0], chunk):
        logits = flat[start : start + chunk] @ lm_head.T  # [n, V] model dtype
        if bias is not None:
            logits = logits + bias
        logits = softcap(logits.float(), cap)
        # lse = m + log(sum(exp(logits - m))), m the row max (whose index is the argmax: the first, as
        # argmax's), in place: one [n, V] buffer, about twice torch.logsumexp + argmax on a CPU
        m, index = logits.max(dim=-1, keepdim=True)
        argmax[start : start + chunk] = index.squeeze(-1)
        m = m.squeeze(-1)
        lse[start : start + chunk] = logits.sub_(m.unsqueeze(-1)).exp_().sum(-1).log_().add_(m)
    return argmax.view(hidden.shape[:-1]), lse.view(hidden.shape[:-1])


def selected_logits(
    hidden: torch.Tensor,
    lm_head_selected: torch.Tensor,
    bias_selected: torch.Tensor | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """The target's logits at the draft-vocab ids. hidden [B, T, H] -> [B, T, Vd] fp32."""
    logits = hidden @ lm_head_selected.T
    if bias_selected is not None:
        logits = logits + bias_selected
    return softcap(logits.float(), cap)


def draft_distribution(
    sel_logits: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target_p [B, T, Vd], target_mass [B, T]) from the draft-vocab logits and the full lse."""
    target_p = torch.softmax(sel_logits, dim=-1)
    target_mass = torch.exp(torch.logsumexp(sel_logits, dim=-1) - lse)
    return target_p, target_mass


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """x[:, t] <- x[:, t+1]; the last position is zero. Works for [B, T, ...]."""
    out = torch.zeros_like(x)
    out[:, :-1] = x[:, 1:]
    return out


def assemble_batch(
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    target_p: torch.Tensor,
    target_mass: torch.Tensor,
    argmax: torch.Tensor,
    t2d: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    final_hidden: torch.Tensor | None = None,
    extras: dict[str, torch.Tensor] | None = None,
    slots: torch.Tensor | None = None,
) -> TargetBatch:
    """Shift the per-token supervision left by one and zero everything at invalid positions.

    All inputs are unshifted and position-aligned: [B, T] (+ [n*H] / [Vd] / [H] trailing dims); the
    hidden states (aux, final) and the extra fields ([B, T, W]) stay position-aligned.

    slots [n]: the stored fields (aux_hidden, target_p, target_mass, argmax, final_hidden, extras) hold
    only these slots of the rows, as ranges back to back (a context-parallel rank's; input_ids,
    attention_mask, loss_mask, position_ids and seq_lens are whole rows). A slot's shifted value comes
    from the next slot of its range, so the last slot of each range gets none: the reader reads one slot
    more than the objective uses (kept_ranges).
    """
    real = attention_mask.bool()  # [B, T]
    valid = shift_left(real) & real  # position t has a next token t+1
    if (
        seq_lens is not None
    ):  # packed: ... of its own document (the last token of a document predicts
        # nothing: the token after it starts the next document, whose first token may carry loss)
        docs, _ = document_ids(seq_lens.to(real.device), real.shape[1])
        valid &= torch.cat([docs[:, 1:] == docs[:, :-1], torch.zeros_like(real[:, :1])], 1)
    loss = shift_left(loss_mask.long()) * valid
    ids = shift_left(input_ids.long()) * valid
    if slots is not None:  # the rank's slots of the whole rows' masks and inputs
        real, valid, loss, ids = (x[:, slots] for x in (real, valid, loss, ids))
    vf = valid.unsqueeze(-1)
    target_ids = shift_left(argmax.long()) * valid
    zero = torch.zeros((), dtype=aux_hidden.dtype, device=aux_hidden.device)
    return TargetBatch(
        aux_hidden=torch.where(real.unsqueeze(-1), aux_hidden, zero),  # pad rows carry no state
        input_ids=ids,
        attention_mask=attention_mask.long(),
        loss_mask=loss,
        target_p=torch.where(vf, shift_left(target_p.float()), 0.0),
        position_mask=t2d.to(target_ids.device)[target_ids] & loss.bool(),
        target_ids=target_ids,
        target_mass=torch.where(valid, shift_left(target_mass.float()), 0.0),
        position_ids=position_ids,
        seq_lens=seq_lens,
        final_hidden=None
        if final_hidden is None
        else torch.where(real.unsqueeze(-1), final_hidden, zero),
        extras={
            name: torch.where(
                real.unsqueeze(-1), value, torch.zeros((), dtype=value.dtype, device=value.device)
            )
            for name, value in (extras or {}).items()
        },
        slots=slots,
    )
