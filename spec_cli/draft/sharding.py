"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for drafts too large to replicate on every rank.

One root: `fully_shard` over the objective (the module whose forward runs a training batch and holds
the draft), as the peers shard their models. Its forward gathers the draft's weights once; the TTT
unroll then calls the draft's pieces (fc, the decoder layers, norm, lm_head) as often as it needs, and
the weights stay gathered until the backward is done (a root does not reshard after its forward: a
one- or two-layer draft called k times per step would gather k times to save one layer's weights).
What FSDP2 saves here is the rest: gradients are reduce-scattered and the optimizer state (Adam: two
fp32 copies) lives sharded, which is most of a large draft's memory.

Mixed precision (`policy`): on GPUs the weights are gathered and computed in bf16 (what the run's bf16
autocast computes in anyway) and gradients reduced in fp32; the batch's tensors are not cast (the
target's probabilities stay fp32). On CPUs, which train in fp32, nothing is cast.

Checkpoints stay full, single-file state dicts, so resume, export and eval do not care how a run was
trained (and a run may resume with another world size or without FSDP).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def policy(device: torch.device):
    """FSDP2's MixedPrecisionPolicy for training on `device` (see the module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type == "cuda":
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def shard(objective: nn.Module, device: torch.device) -> nn.Module:
    """fully_shard the objective in place (one root over the draft it holds); -> the root."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(objective, mp_policy=policy(device))
    return objective


@contextmanager
def no_gradient_sync(root: nn.Module):
    """Accumulate gradients locally (micro-batches before the last of an optimizer step)."""
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    sharded: bool,
    with_optimizer: bool = True,
):
    """(model state dict, optimizer state dict in torch's index-keyed form), full tensors on CPU.
    Frozen parameters (requires_grad False: the embedding copied from the target) are left out; a
    checkpoint does not repeat them. Collective when sharded: every rank calls it, and only rank 0
    receives the optimizer state. with_optimizer False: the model alone (optimizer None)."""
    if not sharded:
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        return (
            {k: v for k, v in model.state_dict().items() if k not in frozen},
            optimizer.state_dict() if with_optimizer else None,
        )
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model_sd = get_model_state_dict(
        model, options=_options(cpu_offload=True, ignore_frozen_params=True)
    )
    if not with_optimizer:
        return model_sd, None
    osd = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if "state" not in osd:  # with cpu_offload only rank 0 receives the full state
        return model_sd, None
    index = {name: i for i, name in enumerate(names)}
    return model_sd, {
        "state": {index[n]: s for n, s in osd["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]
        ],
    }


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_sd: dict,
    optimizer_sd: dict,
    names: list[str],
    sharded: bool,
    frozen: list[str] = (),
) -> None:
    """Inverse of full_state: each rank passes the full state dicts (read from the checkpoint).
    `frozen`: the keys the checkpoint left out (the model already holds them, copied from the target);
    any other missing or unknown key is an error."""
    expected = set(model.state_dict())  # the same names with FSDP2 (DTensor values)
    wrong = sorted((expected - set(model_sd)) ^ set(frozen)) + sorted(set(model_sd) - expected)
    if wrong:
        raise RuntimeError(
            f"the checkpoint does not fit the draft: missing or unexpected keys {wrong[:5]}"
        )
    if not sharded:
        model.load_state_dict(model_sd, strict=False)
        optimizer.load_state_dict(optimizer_sd)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, model_sd, options=_options(strict=False))
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    by_name = {
        "state": {names[i]: s for i, s in optimizer_sd["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in optimizer_sd["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=_options())


# ----------------------------------------------------------------------------- each rank's own shard
# FSDP2 shards every parameter (and AdamW's moments with it) along dim 0 as torch.chunk does: rank r
# holds rows [r * c, min((r + 1) * c, n)) with c = ceil(n / world). A sharded checkpoint stores each
# rank's rows of the optimizer state in a file of its own (no gather), and each rank reads back its
# own rows of the model (a slice of model.safetensors) and its own file.


def shard_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of rank's Shard(0) share of n rows."""
    size = -(-n // world) if n else 0
    start = min(rank * size, n)
    return start, min(size, n - start)


def _local(value, rank: int, world: int) -> tuple[torch.Tensor, int | None]:
    """A DTensor's local rows and their offset (checked against the chunk split), or a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value, None
    local = value.to_local()
    start, rows = shard_rows(value.shape[0], world, rank)
    if tuple(local.shape) != (rows, *value.shape[1:]):
        raise RuntimeError(
            f"unexpected FSDP2 shard: {tuple(local.shape)} of {tuple(value.shape)} on rank {rank}"
        )
    return local, start


def local_optimizer_state(
    optimizer: torch.optim.Optimizer, names: list[str], params: list, rank: int, world: int
) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """This rank's AdamW state, flat (state.<name>.<field>, as checkpoint.flatten_optimizer names them),
    on the CPU, and each tensor's [global shape, first row] (first row None: the whole tensor)."""
    tensors, layout = {}, {}
    for name, p in zip(names, params):
        for field, value in optimizer.state.get(p, {}).items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            local, start = _local(value, rank, world)
            key = f"state.{name}.{field}"
            tensors[key] = local.detach().contiguous().cpu()
            layout[key] = [list(value.shape), start]
    return tensors, layout


def load_local_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    params: list,
    model_file,
    optimizer_tensors: dict,
    groups: list,
    rank: int,
    world: int,
    frozen: list[str] = (),
) -> None:
    """This rank's rows of each parameter from model_file (read as a slice: no rank reads the whole
    file), the buffers whole, and its own optimizer state; the inverse of local_optimizer_state."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    expected = set(model.state_dict())
    with safe_open(str(model_file), framework="pt") as f:
        keys = set(f.keys())
        wrong = sorted((expected - keys) ^ set(frozen)) + sorted(keys - expected)
        if wrong:
            raise RuntimeError(
                f"the checkpoint does not fit the draft: missing or unexpected keys {wrong[:5]}"
            )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in frozen:
                    continue
                if isinstance(p, DTensor):
                    local, start = _local(p, rank, world)
                    local.copy_(f.get_slice(name)[start : start + local.shape[0]])
                else:
                    p.copy_(f.get_tensor(name))
            buffers = {
                name: f.get_tensor(name) for name, _ in model.named_buffers() if name in keys
            }
    model.load_state_dict(buffers, strict=False)
    for name, p in zip(names, params):
        state = {}
        for key in [k for k in optimizer_tensors if k.startswith(f"state.{name}.")]:
            field = key.rsplit(".", 1)[1]
            value = optimizer_tensors[key]
            if isinstance(p, DTensor) and value.dim() > 0:
                value = DTensor.from_local(
                    value.to(p.device, p.dtype),
                    p.device_mesh,
                    p.placements,
                    shape=p.shape,
                    stride=p.stride(),
                    run_check=False,
                )
            state[field] = value
        if state:
            optimizer.state[p] = state
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
