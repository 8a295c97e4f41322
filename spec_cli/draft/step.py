"""The training step shared by `spec train` (spec_cli/trainer/) and `spec plan` (plan/step.py, which runs
it on fake tensors to measure it): the optimizer (spec_cli/draft/optim.py), one micro-batch's forward
and backward, the update.

Kept here, below both, so that the plan measures exactly the code the trainer runs."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from spec_cli.draft.optim import make_optimizer  # noqa: F401  (the trainer, spec plan and benches take it from here)


def optimizer_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's param groups as its state_dict writes them (hyperparameters, parameter indices)."""
    out, start = [], 0
    for group in optimizer.param_groups:
        out.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": list(range(start, start + len(group["params"]))),
            }
        )
        start += len(group["params"])
    return out


def forward_backward(
    objective,
    model,
    batch,
    grad_accum: int,
    autocast,
    hold_gradients=None,
    sync: bool = True,
    gradient_scale: int = 1,
):
    """One micro-batch's forward and backward through `model` (the objective or its DDP / FSDP2 wrap),
    its loss divided by grad_accum; the objective's units (P-EAGLE's segments) one after another.
    hold_gradients: under torchrun, a context that keeps the ranks from sharing gradients (None: one
    process); sync: this is the step's last micro-batch, whose last unit shares them. gradient_scale:
    --context-parallel's N, by which each rank's share of the batch's loss is multiplied before
    backward: DDP and FSDP2 average gradients over all ranks, and the N shares of a batch must add up."""
    units = objective.plan(batch)  # P-EAGLE's segments: one forward and backward each
    outs = []
    for i, unit in enumerate(units):
        share = hold_gradients is None or (sync and i == len(units) - 1)
        with nullcontext() if share else hold_gradients(), autocast:
            out = model(batch, unit)
            (
                out.loss * (gradient_scale / grad_accum)
            ).backward()  # each backward adds: average them
        outs.append(out)
    return outs[0] if len(outs) == 1 else outs[0].merge(outs)


def optimizer_step(params: list, optimizer, grad_clip: float) -> torch.Tensor:
    """Clip (grad_clip > 0), step and zero the gradients; returns their global norm before clipping, on the
    device (no host wait: the trainer logs it with the metrics)."""
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:  # the norm alone (no pass multiplying every gradient by 1)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (
        norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    )  # (FSDP2: a replicated DTensor)
