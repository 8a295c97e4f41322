"""How many bytes `spec train --stream`'s store may hold, decided before the target is loaded.

One sample is one batch's supervision, and its size is known up front: spec_cli/batch.py's
batch_nbytes of the run's largest planned batch (plus SAMPLE_OVERHEAD, a --stream-dir file's header).

auto   --prefetch + 1 such batches (the ones the producers run ahead plus the one the trainer reads),
       within ROOM_SHARE of what is free where the samples will live: host memory, the GPU's memory for
       an in-process target on a GPU (the store keeps its tensors where the target made them), or the
       disk of --stream-dir. Less room: the bound is lowered to the whole batches that fit, with a line
       in the log (the producers then run fewer batches ahead); not even one batch: refused.
given  --stream-max-bytes as written; refused when it is smaller than one batch (it could never hold
       one), and not checked against the free room (the user chose it).

A refusal stops the run before the target is loaded or anything is written.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from spec_cli.errors import ConfigError

SAMPLE_OVERHEAD = (
    64 << 10
)  # a sample's bytes beyond its tensors: a --stream-dir file's header (~1.5 KiB)
ROOM_SHARE = 0.75  # of the free room, what the store may take; the rest is the target's, the draft's, the data's


@dataclass(frozen=True)
class StoreBound:
    max_bytes: int
    source: str  # where it came from, for the log and stream.json: "auto: 3 batches of 4.66 GiB"


def store_bound(
    given: int | None,
    batch_bytes: int,
    batches: int,
    free: int | None = None,
    where: str = "host memory",
) -> StoreBound:
    """The store's byte bound for samples of `batch_bytes` (the largest batch's tensors): `given`, or
    (None) `batches` of them within ROOM_SHARE of `free` bytes free in `where` (None: unknown)."""
    one = batch_bytes + SAMPLE_OVERHEAD  # one sample's room in the store
    if given is not None:
        if given < one:
            raise ConfigError(
                f"--stream-max-bytes {size_text(given)} is smaller than one batch of this run "
                f"({size_text(one)}, its largest), which the stream store could never hold",
                f"raise --stream-max-bytes to at least {math.ceil(one / 2**20)}M (or leave it "
                "out: auto), or lower --batch-tokens",
            )
        return StoreBound(given, "given: --stream-max-bytes")
    room = None if free is None else int(free * ROOM_SHARE)
    if room is not None and room < one:
        raise ConfigError(
            f"one batch of this run holds {size_text(one)} of supervision, more than the stream "
            f"store may take of {where} ({size_text(room)}: {ROOM_SHARE:.0%} of {size_text(free)} free)",
            "lower --batch-tokens, or free room there (--stream-dir keeps the store on a disk)",
        )
    n = batches if room is None else min(batches, room // one)
    source = f"auto: {n} batch{'es' if n > 1 else ''} of {size_text(one)}"
    if n < batches:
        source += f", lowered from {batches} (--prefetch + 1): {size_text(free)} of {where} free"
    return StoreBound(n * one, source)


def free_room(stream_dir: Path | None, device: torch.device) -> tuple[int | None, str]:
    """(bytes free now where the store's samples will live, what that is; None: unknown): the disk of
    `stream_dir`, else the memory of `device` (the tensors' device: the GPU's, or the host's). The ranks
    of one machine (torchrun) share its host memory and disks, each with its own store."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    shared = f" (a 1/{ranks} share: {ranks} ranks)" if ranks > 1 else ""
    if stream_dir is not None:
        folder = Path(stream_dir).absolute()
        while not folder.exists() and folder != folder.parent:  # made by the store
            folder = folder.parent
        return shutil.disk_usage(folder).free // ranks, f"the disk of {stream_dir}{shared}"
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"the memory of {device}"
    available = host_available()
    return (None if available is None else available // ranks), f"host memory{shared}"


def host_available() -> int | None:
    """The host memory available to a new allocation (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:  # free pages only: less than what is available (page cache not counted)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def size_text(n: int) -> str:
    """Bytes as a person reads them: 4.66 GiB, 266.3 KiB, 1000 bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n} bytes"
