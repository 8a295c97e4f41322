"""torch.distributed helpers for stages launched with `torchrun` (one process per device).

The process group. One group with a backend per device type: `cpu:gloo,cuda:nccl` on GPUs, `cpu:gloo`
on CPUs. NCCL carries CUDA tensors only, and the host keeps some things that every rank must agree on
("out of time?" flags, the shard entries precompute gathers, barriers); with the
device map each collective goes to the backend that serves its tensor's device, so a CPU tensor never
reaches NCCL ("No backend type associated with device type cpu" on an NCCL-only group). On CUDA each
rank is bound to its GPU before the group forms: `torch.cuda.set_device(cuda:LOCAL_RANK)` and
`device_id=` (NCCL then connects eagerly, to the right GPU).

Timeouts. Collectives wait `SPEC_DIST_TIMEOUT` seconds (default 30 minutes) before a rank gives up.
Work that rank 0 does alone while the others wait (tokenising the data set) is waited for with a
timeout sized to that work (`wait_for_main`), on a gloo group of its own, after the waiting ranks say
what they wait for.

Threads. Ranks on one machine share its cores: each takes cores / LOCAL_WORLD_SIZE intra-op threads
(spec_cli/threads.py, `choose_for_run`), not all of them.

The helpers act only under torchrun (WORLD_SIZE > 1): an in-process vLLM engine initialises a
one-process gloo group of its own, which these helpers must neither wait on nor destroy (a later engine
in the same process needs it).
"""

from __future__ import annotations

import os
import secrets
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from spec_cli import threads
from spec_cli.console import info
from spec_cli.errors import ConfigError, TrainingError

DEFAULT_TIMEOUT_S = (
    1800.0  # a collective's wait; torch's own default (10 min) is short for a checkpoint
)

_WAIT_GROUP = None  # gloo group for wait_for_main (monitored_barrier is gloo-only)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _ours() -> bool:
    """Is there a torchrun process group (not one a vLLM engine made for itself)?"""
    return world_size() > 1 and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _ours() else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def timeout_s() -> float:
    """SPEC_DIST_TIMEOUT (seconds), else DEFAULT_TIMEOUT_S."""
    raw = os.environ.get("SPEC_DIST_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"SPEC_DIST_TIMEOUT={raw!r} is not a number of seconds above 0",
            "set it to the seconds a collective may wait, e.g. 3600, or unset it",
        )
    return value


def backend_for(device: torch.device) -> str:
    """The process group's backend per device type: host tensors on gloo everywhere, and the compute
    device's on NCCL when it is a GPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "cpu:gloo"


def served_device_types(backend: str) -> set[str]:
    """The device types a backend string routes: 'cpu:gloo,cuda:nccl' -> {cpu, cuda}; a bare name the
    device types that backend alone carries."""
    if ":" in backend:
        return {part.split(":")[0].strip() for part in backend.split(",")}
    return {"nccl": {"cuda"}, "gloo": {"cpu", "cuda"}, "mpi": {"cpu", "cuda"}}.get(backend, set())


def local_device(device: torch.device) -> torch.device:
    """This rank's device: under torchrun, cuda -> cuda:LOCAL_RANK. An explicit cuda:N is refused when
    several ranks share the machine (they would all land on GPU N)."""
    if device.type != "cuda" or world_size() == 1:
        return device
    if device.index is not None and threads.ranks_here() > 1:
        raise ConfigError(
            f"--device {device} under torchrun would put all {threads.ranks_here()} ranks of this "
            f"machine on GPU {device.index}",
            "pass --device cuda: rank r takes cuda:LOCAL_RANK (CUDA_VISIBLE_DEVICES picks the GPUs)",
        )
    index = local_rank() if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(
            f"LOCAL_RANK {index} has no GPU: this machine shows {count}",
            "launch at most that many processes per node (torchrun --nproc-per-node), or "
            "check CUDA_VISIBLE_DEVICES",
        )
    return torch.device("cuda", index)


def init(device: torch.device | None = None) -> None:
    """Join the process group when launched by torchrun (see the module docstring)."""
    global _WAIT_GROUP
    if world_size() == 1 or dist.is_initialized():
        return
    device = device or torch.device("cpu")
    kwargs = {"backend": backend_for(device), "timeout": timedelta(seconds=timeout_s())}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    _WAIT_GROUP = dist.new_group(backend="gloo", timeout=kwargs["timeout"])


def barrier() -> None:
    if _ours():
        dist.barrier()


def wait_for_main(what: str, seconds: float) -> None:
    """A barrier for work rank 0 does alone (call it on every rank once rank 0 is done): the other ranks
    wait up to max(`seconds`, the collective timeout) and fail with one line naming `what` if rank 0
    has not arrived by then, instead of a watchdog's abort at the group's timeout."""
    if not _ours():
        return
    limit = max(float(seconds), timeout_s())
    if not is_main():
        info(
            f"rank {rank()}: waiting for rank 0 to finish {what} (up to {limit / 60:.0f} min)",
            every_rank=True,
        )
    try:
        dist.monitored_barrier(
            group=_WAIT_GROUP, timeout=timedelta(seconds=limit), wait_all_ranks=True
        )
    except RuntimeError as exc:
        raise TrainingError(
            f"rank {rank()} waited {limit:.0f} s for the other ranks to finish {what}: "
            f"{str(exc).splitlines()[0]}",
            "see rank 0's log; SPEC_DIST_TIMEOUT (seconds) allows longer waits",
        ) from exc


def max_over_ranks(n: int) -> int:
    """The largest of every rank's `n` (on every rank). A host tensor: the group routes it to gloo."""
    if not _ours():
        return n
    t = torch.tensor([int(n)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any (so all ranks stop at the same step). A host tensor:
    the group routes it to gloo."""
    if not _ours():
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def max_in_place(t: torch.Tensor) -> torch.Tensor:
    """`t` replaced by its elementwise largest over the ranks, on its own device (NCCL for a GPU tensor:
    queued on the stream, read by the caller's next host sync, so it adds no wait of its own)."""
    if _ours():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def gather_to_main(obj):
    """Every rank's `obj` (picklable, made by this program) on rank 0 as a list by rank; None elsewhere.
    Through the group's host backend."""
    if not _ours():
        return [obj]
    out = [None] * world_size() if is_main() else None
    dist.gather_object(obj, out, dst=0)
    return out


def check_shared_folder(folder: Path, what: str) -> None:
    """Every rank must see `folder` as rank 0 does (checkpoints and shards are written by one rank and
    read by others): rank 0 writes a fresh token there and every rank reads it back. A rank that cannot
    (nodes without a shared file system, each writing its own disk) is one error on every rank, at once,
    instead of ranks resuming at different steps and hanging in their next collective."""
    if not _ours():
        return
    folder = Path(folder)
    token = [
        secrets.token_hex(8) if is_main() else None,
        None,
    ]  # [token, the name of the file holding it]
    try:
        if is_main():
            folder.mkdir(parents=True, exist_ok=True)
            token[1] = f".spec-ranks-{os.getpid()}"  # hidden: the folder guards allow it
            (folder / token[1]).write_text(token[0])
        dist.broadcast_object_list(token, src=0)
        try:
            sees = (folder / token[1]).read_text() == token[0]  # this rank's view of the folder
        except OSError:
            sees = False
        blind = [None] * world_size()
        dist.all_gather_object(blind, None if sees else (rank(), socket.gethostname()))
    finally:
        if is_main() and token[1]:
            (folder / token[1]).unlink(missing_ok=True)
    blind = [b for b in blind if b is not None]
    if blind:
        who = ", ".join(f"rank {r} on {host}" for r, host in blind)
        raise ConfigError(
            f"{who} cannot see {what} {folder} as rank 0 ({socket.gethostname()}) writes it",
            "put it on a file system every node mounts at the same path (NFS, Lustre, ...)",
        )


def machine_mesh(device: torch.device):
    """A one-dimensional device mesh over this machine's ranks (torchrun's ranks are numbered machine by
    machine): what a tensor-parallel target is sharded over, so its all-reduces stay inside a node."""
    from torch.distributed.device_mesh import init_device_mesh

    here, world = threads.ranks_here(), world_size()
    if world % here:
        raise ConfigError(
            f"{world} ranks in all but {here} on this machine",
            "launch the same number of processes on every machine (torchrun --nproc-per-node)",
        )
    mesh = init_device_mesh(device.type, (world // here, here), mesh_dim_names=("machine", "local"))
    return mesh["local"]


def context_group(size: int):
    """(this rank's place in its context-parallel group, the group): `size` consecutive ranks per group
    (torchrun numbers ranks machine by machine, so a group stays inside a node when size divides the
    node's ranks: its all-gathers never cross the network). Every rank makes every group, as
    torch.distributed.new_group requires."""
    world, rank_ = world_size(), rank()  # (size divides world: Schedule.plan checked it)
    mine = None
    for start in range(0, world, size):
        group = torch.distributed.new_group(list(range(start, start + size)))
        if start <= rank_ < start + size:
            mine = group
    return rank_ % size, mine


def shutdown() -> None:
    global _WAIT_GROUP
    if _ours():
        dist.destroy_process_group()
        _WAIT_GROUP = None
