"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for drafts too large to replicate on every rank.

Every module that owns parameters directly (each Linear, norm and the frozen embedding) is its own
FSDP unit: the TTT unroll calls the draft's pieces (fc, the decoder layer, norm, lm_head) directly and
several times per step rather than through one `forward`, and a unit's hooks fire on every call of its
own module. Units keep their gathered weights from forward to backward (`reshard_after_forward=False`)
so the k calls of a TTT step gather once; gradients are reduce-scattered and the optimizer state lives
sharded. Checkpoints stay full, single-file state dicts, so resume, export and eval do not care how a
run was trained (and a run may resume with another world size or without FSDP).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def shard(model: nn.Module) -> list[nn.Module]:
    """Apply fully_shard to every module of `model` that owns parameters; -> those units."""
    from torch.distributed.fsdp import fully_shard

    units = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    for unit in units:
        fully_shard(unit, reshard_after_forward=False)
    return units


@contextmanager
def no_gradient_sync(units: list[nn.Module]):
    """Accumulate gradients locally (micro-batches before the last of an optimizer step)."""
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str], sharded: bool):
    """(model state dict, optimizer state dict in torch's index-keyed form), full tensors on CPU.
    Frozen parameters (requires_grad False: the embedding copied from the target) are left out; a
    checkpoint does not repeat them. Collective when sharded: every rank calls it, and only rank 0
    receives the optimizer state."""
    if not sharded:
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        return ({k: v for k, v in model.state_dict().items() if k not in frozen},
                optimizer.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd = get_model_state_dict(model, options=_options(cpu_offload=True, ignore_frozen_params=True))
    osd = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if "state" not in osd:  # with cpu_offload only rank 0 receives the full state
        return model_sd, None
    index = {name: i for i, name in enumerate(names)}
    return model_sd, {"state": {index[n]: s for n, s in osd["state"].items()},
                      "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                       for g in osd["param_groups"]]}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optimizer_sd: dict,
                    names: list[str], sharded: bool, frozen: list[str] = ()) -> None:
    """Inverse of full_state: each rank passes the full state dicts (read from the checkpoint).
    `frozen`: the keys the checkpoint left out (the model already holds them, copied from the target);
    any other missing or unknown key is an error."""
    expected = set(model.state_dict())  # the same names with FSDP2 (DTensor values)
    wrong = sorted((expected - set(model_sd)) ^ set(frozen)) + sorted(set(model_sd) - expected)
    if wrong:
        raise RuntimeError(f"the checkpoint does not fit the draft: missing or unexpected keys {wrong[:5]}")
    if not sharded:
        model.load_state_dict(model_sd, strict=False)
        optimizer.load_state_dict(optimizer_sd)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, model_sd, options=_options(strict=False))
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    by_name = {"state": {names[i]: s for i, s in optimizer_sd["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                for g in optimizer_sd["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=_options())
