"""Losses and metrics of one TTT step (docs/eagle.md "Losses and metrics").

Every function takes the N supervised positions of a step, already gathered: draft logits [N, Vd],
target_p [N, Vd] (the target's softmax over the draft vocab), target_mass [N] (the draft-vocab mass
under the target's full-vocab normaliser). Means are over N; a step with N = 0 gives exactly 0 and a
zero (not NaN) gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from spec_cli.artifacts import vocab_map

LOSSES = ("soft-ce", "lk-alpha", "lk-lambda")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits -> fp32 for the softmax; fp32/fp64 stay as they are."""
    return x.float() if x.element_size() < 4 else x


def _mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the supervised positions; 0 when there are none."""
    return x.sum() / max(x.numel(), 1)


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """mean_n -sum_v target_p * log_softmax(logits). [..., Vd] -> []."""
    return _SoftCrossEntropy.apply(logits.flatten(0, -2), target_p.flatten(0, -2))


class _SoftCrossEntropy(torch.autograd.Function):
    """Soft-CE whose gradient, (softmax(logits) * sum_v target_p - target_p) / N, is formed in forward:
    backward then keeps one [N, Vd] tensor instead of both log_softmax and target_p."""

    @staticmethod
    def forward(ctx, logits, target_p):
        n = max(logits.shape[0], 1)
        logp = _upcast(logits).log_softmax(-1)  # [N, Vd]
        loss = -(target_p * logp).sum() / n
        grad = logp.exp_().mul_(target_p.sum(-1, keepdim=True)).sub_(target_p).div_(n)
        ctx.save_for_backward(grad.to(logits.dtype))
        return loss

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g, None


HEAD_CHUNK_BYTES = 256 << 20  # fp32 logits of one chunk of positions in chunked_soft_ce


def chunked_soft_ce(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    state: torch.Tensor,
    where: tuple,
    target_p: torch.Tensor,
    at: tuple,
    vocab: int,
    weight: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """soft_cross_entropy(logits_of(state[where]), target_p[at] * weight) and the logits' argmax [N],
    chunk by chunk of positions, each chunk checkpointed: no [N, V] tensor ever exists (not the logits,
    their fp32 log-softmax, the gathered target_p, nor the gradient) and nothing of a chunk is kept for
    backward but its indices, which recomputes the chunk. Activation checkpointing of the head at the
    memory of one chunk, for long rows, whose step is recomputed anyway.

    logits_of: [c, H] -> [c, V]; where / at: tuples of [N] index tensors into state's and target_p's
    leading dims (the scored states, their targets); weight [N]: 0 drops a position's target (it then
    adds nothing); vocab V sizes the chunks."""
    if chunk_rows is None:
        chunk_rows = max(1, HEAD_CHUNK_BYTES // (4 * vocab))
    n = where[0].shape[0]
    if n == 0:  # the plain head on nothing: 0, with a (zero) gradient like any other step's
        return _soft_ce_sum(logits_of, state, where, target_p, at, weight)
    loss = state.new_zeros(
        (), dtype=torch.float64 if state.dtype == torch.float64 else torch.float32
    )
    argmax = []
    for start in range(0, n, chunk_rows):
        part = slice(start, start + chunk_rows)
        value, top = activation_checkpoint(
            _soft_ce_sum,
            logits_of,
            state,
            tuple(i[part] for i in where),
            target_p,
            tuple(i[part] for i in at),
            None if weight is None else weight[part],
            use_reentrant=False,
        )
        loss = loss + value
        argmax.append(top)
    return loss / n, torch.cat(argmax)


def _soft_ce_sum(
    logits_of, state, where, target_p, at, weight
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's soft-CE summed over its positions, and its argmax."""
    logits = logits_of(state[where])  # [c, V]
    p = target_p[at] if weight is None else target_p[at] * weight[:, None]
    return soft_cross_entropy(logits, p) * where[0].shape[0], logits.detach().argmax(-1)


def acceptance(
    logits: torch.Tensor, target_p: torch.Tensor, target_mass: torch.Tensor
) -> torch.Tensor:
    """alpha [N] = sum_v min(p_target, p_draft) over the draft vocab: the probability that
    speculative sampling accepts the draft's token. p_target uses the full-vocab normaliser."""
    p_target = target_p * target_mass[..., None]  # [N, Vd]
    p_draft = _upcast(logits).softmax(-1)  # [N, Vd]
    return torch.minimum(p_target, p_draft).sum(-1)


def lk_alpha_loss(alpha: torch.Tensor) -> torch.Tensor:
    """-mean(log alpha); positions with alpha == 0 contribute 0 (and no NaN gradient)."""
    accepted = alpha > 0
    return _mean(-torch.where(accepted, alpha, torch.ones_like(alpha)).log())


def lk_lambda_loss(
    soft_ce: torch.Tensor,
    alpha: torch.Tensor,
    kl_scale: float = 1.0,
    kl_decay: float = 1.0,
    weight_alpha: torch.Tensor | None = None,
) -> torch.Tensor:
    """w * soft_ce + (1 - w) * (1 - mean(alpha)),  w = kl_scale * exp(-kl_decay * mean(alpha)):
    mostly soft-CE while the draft is poor, mostly acceptance once it is good. weight_alpha: the mean
    alpha w is computed from, when it is not this call's (context parallelism: the whole batch's, so that
    each rank's loss is its share of the single-process loss; the rest is linear in the positions)."""
    mean_alpha = _mean(alpha)
    w = kl_scale * torch.exp(
        -kl_decay * (mean_alpha if weight_alpha is None else weight_alpha).detach()
    )
    return w * soft_ce + (1 - w) * (1 - mean_alpha)


def step_loss(
    logits: torch.Tensor,
    target_p: torch.Tensor,
    target_mass: torch.Tensor,
    loss: str = "soft-ce",
    kl_scale: float = 1.0,
    kl_decay: float = 1.0,
    group_mean: Callable | None = None,
) -> torch.Tensor:
    """The loss of one TTT step over its N supervised positions. group_mean(sum, count) -> the mean over a
    context-parallel group's positions (lk-lambda's weight reads it)."""
    if loss == "soft-ce":
        return soft_cross_entropy(logits, target_p)
    alpha = acceptance(logits, target_p, target_mass)
    if loss == "lk-alpha":
        return lk_alpha_loss(alpha)
    if loss == "lk-lambda":
        weight_alpha = (
            None if group_mean is None else group_mean(alpha.detach().sum(), alpha.numel())
        )
        return lk_lambda_loss(
            soft_cross_entropy(logits, target_p), alpha, kl_scale, kl_decay, weight_alpha
        )
    raise ValueError(f"unknown loss {loss!r}: use one of {', '.join(LOSSES)}")


def top1_correct(logits: torch.Tensor, d2t: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Number of positions where the draft's argmax, mapped to a target id through d2t (offsets),
    equals the target's argmax. logits [N, Vd], target_ids [N] target-vocab ids."""
    return top1_hits(logits.argmax(-1), d2t, target_ids)


def top1_hits(argmax: torch.Tensor, d2t: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """top1_correct from the draft's argmax [N] (draft-vocab ids)."""
    return (vocab_map.to_target_ids(argmax, d2t) == target_ids).sum()


def step_weights(ttt_steps: int, step_weight: float) -> list[float]:
    """step_weight**k for k < ttt_steps, normalised to sum 1."""
    raw = [step_weight**k for k in range(ttt_steps)]
    return [w / sum(raw) for w in raw]


def acceptance_length(accuracy: torch.Tensor) -> torch.Tensor:
    """Simulated acceptance length 1 + sum_k prod_{j<=k} acc_j from per-step top-1 accuracy [K]:
    step k's token is accepted only if every earlier one was."""
    return 1 + torch.cumprod(accuracy.double(), 0).sum()
