"""torch.distributed helpers for stages launched with `torchrun` (one process per device).

They act only under torchrun (WORLD_SIZE > 1): an in-process vLLM engine initialises a one-process
gloo group of its own, which these helpers must neither wait on nor destroy (a later engine in the same
process needs it).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _ours() -> bool:
    """Is there a torchrun process group (not one a vLLM engine made for itself)?"""
    return world_size() > 1 and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _ours() else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def init(device: torch.device | None = None) -> None:
    """Join the process group when launched by torchrun (gloo on CPU, NCCL on CUDA)."""
    if world_size() > 1 and not dist.is_initialized():
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)


def local_device(device: torch.device) -> torch.device:
    """cuda -> cuda:LOCAL_RANK under torchrun."""
    if device.type == "cuda" and device.index is None and world_size() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def barrier() -> None:
    if _ours():
        dist.barrier()


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank when `flag` is true on any (so all ranks stop at the same step)."""
    if not _ours():
        return flag
    t = torch.tensor([1 if flag else 0], device=device or torch.device("cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shutdown() -> None:
    if _ours():
        dist.destroy_process_group()
