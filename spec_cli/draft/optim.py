"""The draft's optimizers, AdamW (the default) or Muon for the matrices with AdamW for the rest, and
the learning-rate schedule over them.

Muon (torch.optim.Muon: momentum, then the update orthogonalised by a Newton-Schulz iteration) suits
the draft's hidden-by-hidden matrices (fc, attention, MLP). Its update has no meaning for a vector
(norm weights) and is not used for the vocabulary matrices (lm_head, embed_tokens), whose rows are
tokens, not directions: those stay on AdamW, as Muon's authors and speculators do.

`MuonAdamW` is ONE torch.optim.Optimizer over both parts, so that everything that handles "the
optimizer" keeps working unchanged: its param_groups (matrices first, then the rest) and its state
are those of the two inner optimizers, shared by reference, so state_dict / load_state_dict, the
checkpoint's flat tensors, FSDP2's per-rank rows and the LR schedule see one optimizer. The trainer
orders its parameter list as the groups are (`ordered`), because a state_dict numbers parameters in
group order.

Each group carries `lr_scale`, its learning rate over --lr (1 for AdamW's; --muon-lr / --lr for
Muon's): the schedule (`lr_at`) gives the step's value and `set_lr` sets lr = scale x that value in
every group. The schedule sits here, beside the optimizers, because it reaches them only through
those groups: `scheduled_lr` reads the value back the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ADAMW_BETAS = (0.9, 0.95)
# 2-D weights kept on AdamW: token-indexed tables (rows are tokens, not directions)
VOCAB_MATRICES = (
    "lm_head",
    "embed_tokens",
    "markov_w1",
    "markov_w2",
)  # (DSpark's Markov head: vocab rows)


def is_matrix(name: str, param: torch.Tensor) -> bool:
    """Muon's parameters: 2-D, both sides > 1, not a vocabulary table."""
    return param.ndim == 2 and min(param.shape) > 1 and not any(v in name for v in VOCAB_MATRICES)


def ordered(named: Sequence[tuple[str, torch.Tensor]], optim) -> list[tuple[str, torch.Tensor]]:
    """The trained parameters in the order the optimizer's groups hold them (its state_dict numbering)."""
    if getattr(optim, "optimizer", "adamw") != "muon":
        return list(named)
    return [x for x in named if is_matrix(*x)] + [x for x in named if not is_matrix(*x)]


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over `matrices`, torch.optim.AdamW over `others`, as one optimizer."""

    def __init__(
        self,
        matrices: list,
        others: list,
        lr: float,
        muon_lr: float,
        weight_decay: float,
        muon_weight_decay: float,
        momentum: float = 0.95,
    ):
        parts = []
        if matrices:
            # match_rms_adamw: Muon's update scaled to AdamW's RMS, so --lr means the same on both parts
            parts.append(
                torch.optim.Muon(
                    matrices,
                    lr=muon_lr,
                    weight_decay=muon_weight_decay,
                    momentum=momentum,
                    adjust_lr_fn="match_rms_adamw",
                )
            )
        if others:
            parts.append(
                torch.optim.AdamW(others, lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)
            )
        if not parts:
            raise ValueError("no parameters to optimize")
        self.parts = parts
        super().__init__(
            [p for part in parts for g in part.param_groups for p in g["params"]], {"lr": lr}
        )
        self.param_groups = [g for part in parts for g in part.param_groups]
        for group in self.param_groups:
            group["lr_scale"] = group["lr"] / lr
        self._share()

    def _share(self) -> None:
        """One list of groups and one state, the inner optimizers holding their slices of them."""
        start = 0
        for part in self.parts:
            n = len(part.param_groups)
            part.param_groups = self.param_groups[start : start + n]
            part.state = self.state
            start += n

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(
            state_dict
        )  # new group dicts and a new state: hand them to the parts
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss


def make_optimizer(params: list, optim, names: list[str] | None = None) -> torch.optim.Optimizer:
    """The optimizer `optim` (OptimOptions: optimizer, lr, weight_decay, muon_lr, muon_weight_decay)
    asks for over `params`; Muon needs their `names` (to keep lm_head and embeddings on AdamW) and
    `params` in `ordered` order."""
    kind = getattr(optim, "optimizer", "adamw")
    if kind == "adamw":
        return torch.optim.AdamW(
            params, lr=optim.lr, betas=ADAMW_BETAS, weight_decay=optim.weight_decay
        )
    if kind != "muon":
        raise ValueError(f"unknown optimizer {kind!r}: use adamw or muon")
    if names is None:
        raise ValueError("Muon needs the parameters' names")
    flags = [is_matrix(n, p) for n, p in zip(names, params)]
    if flags != sorted(flags, reverse=True):
        raise ValueError("Muon: pass the parameters in optim.ordered() order (matrices first)")
    return MuonAdamW(
        [p for p, m in zip(params, flags) if m],
        [p for p, m in zip(params, flags) if not m],
        lr=optim.lr,
        muon_lr=optim.muon_lr or optim.lr,
        weight_decay=optim.weight_decay,
        muon_weight_decay=optim.muon_weight_decay,
    )


def lr_at(step: int, total: int, optim) -> float:
    """The learning rate of optimizer step `step` (from 0) of `total`, for `optim` (OptimOptions):
    linear warmup, then to min_lr_ratio * lr: a cosine over the rest (--schedule cosine), or held
    flat until the last decay_ratio of the steps and decayed linearly over them (wsd)."""
    warmup = max(1, math.ceil(optim.warmup_ratio * total)) if optim.warmup_ratio > 0 else 0
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    floor = optim.min_lr_ratio
    if getattr(optim, "schedule", "cosine") == "wsd":
        decay = max(1, math.ceil(optim.decay_ratio * total))
        start = max(warmup, total - decay)  # the decay's first step
        if step < start:
            return optim.lr
        progress = (step - start + 1) / max(1, total - start)  # the last step reaches the floor
        return optim.lr * (floor + (1 - floor) * (1 - min(1.0, progress)))
    progress = (step - warmup) / max(1, total - warmup)
    return optim.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's value for this step, times each group's lr_scale (1 without one)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def scheduled_lr(optimizer: torch.optim.Optimizer) -> float:
    """The schedule's value the optimizer was last set to: its first group's lr over its
    lr_scale."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)
