"""How many intra-op threads a timed stage uses, and whether the machine let it have them.

OpenMP threads spin-wait for each other at the end of every parallel op. When another process holds
one of the cores, each op waits for the thread that lost its core, so on a 2-core machine with a busy
neighbour two threads run several times slower than one (docs/results.md). `choose` leaves the
cores other processes are busy on to them; `Meter` says afterwards whether the run got the cores it
used, so that a speed measured on a crowded machine is flagged rather than trusted.

    other load    cores kept busy by other processes on the cores we may use: busy time in
                  /proc/stat over a short window, minus this process's own CPU time
    cpu share     CPU time this process got / (wall time x threads): 1.0 when no thread waited
    contention    other load - the cores we left free (cores - threads): how much of our own
                  threads' cores the neighbours took
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SAMPLE_SECONDS = (
    0.25  # how long `other_load` watches the machine before choosing (small next to loading)
)
IDLE_NOISE = 0.25  # cores of background work (daemons, a shell) not worth giving up a thread for
# A run is flagged when its figures measure the machine's queue more than the decoders:
MIN_CPU_SHARE = 0.7  # our threads waited for a core over 30% of the time
MAX_CONTENTION = 0.5  # neighbours held half a core of the ones our threads ran on, on average


@dataclass(frozen=True)
class Choice:
    threads: int
    reason: str


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (containers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def choose(
    cores: int, other_load: float | None, requested: int | None = None, env: str | None = None
) -> Choice:
    """The intra-op thread count for a timed run: --threads if given, else OMP_NUM_THREADS if set,
    else the cores other processes are not busy on (at least one)."""
    if requested is not None:
        extra = f" (more than the {cores} cores this process may use)" if requested > cores else ""
        return Choice(requested, f"--threads {requested}{extra}")
    if _count(env):
        return Choice(_count(env), f"OMP_NUM_THREADS={_count(env)} in the environment")
    if other_load is None:
        return Choice(cores, f"all {cores} cores (the machine's load is unknown here)")
    taken = max(0, math.ceil(other_load - IDLE_NOISE))  # cores to leave to the neighbours
    threads = max(1, cores - taken)
    if threads == cores:
        return Choice(threads, f"all {cores} cores (other processes: {other_load:.1f} cores busy)")
    return Choice(
        threads, f"{threads} of {cores} cores: other processes kept {other_load:.1f} cores busy"
    )


def ranks_here() -> int:
    """Processes of one torchrun launch on this machine (LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    return _count(os.environ.get("LOCAL_WORLD_SIZE")) or 1


def choose_for_run(requested: int | None = None) -> Choice:
    """`choose` on this machine now; the load is sampled only when the choice depends on it. Under
    torchrun the machine's cores are shared by its ranks (no oversubscription: 8 ranks on 96 cores take
    12 each, not 96 each); torchrun's own OMP_NUM_THREADS, when it set one, still wins."""
    cores, ranks = available_cores(), ranks_here()
    env = os.environ.get("OMP_NUM_THREADS")
    if ranks > 1:
        share = max(1, cores // ranks)
        if requested is None and not _count(env):
            return Choice(
                share, f"{share} of {cores} cores: shared by the {ranks} ranks on this machine"
            )
        return choose(share, None, requested, env)
    auto = requested is None and not _count(env) and cores > 1
    return choose(cores, other_load() if auto else None, requested, env)


def _count(env: str | None) -> int | None:
    """OMP_NUM_THREADS as torch reads it: a positive integer, else not set."""
    return int(env) if env and env.strip().isdigit() and int(env) > 0 else None


@contextlib.contextmanager
def applied(threads: int, restore: bool = True):
    """torch's intra-op threads set to `threads` inside, the earlier count back after (restore=False:
    leave it, e.g. after vLLM took over torch.set_num_threads)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        if restore:
            torch.set_num_threads(previous)


# ----------------------------------------------------------------------------- measuring


def niced_work_yields() -> bool:
    """Whether other processes' niced CPU time (the `nice` column of /proc/stat) would go to us when we
    wanted it: we run at nice 0 or below, and the scheduler weighs nice across the whole machine (no
    autogroups; with them a niced process in another session still gets its group's full share)."""
    try:
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() != "0"
    except OSError:
        autogroup = False
    return not autogroup and os.getpriority(os.PRIO_PROCESS, 0) <= 0


def busy_seconds(
    text: str | None = None, cpus: set[int] | None = None, count_niced: bool | None = None
) -> float | None:
    """CPU seconds spent busy (everything but idle and iowait) on `cpus` (default: ours) since boot,
    from /proc/stat; None where there is none. Niced time is left out when it yields to us
    (`niced_work_yields`, or `count_niced=False`): a niced neighbour takes none of our cores."""
    if count_niced is None:
        count_niced = not niced_work_yields()
    if text is None:
        try:
            text = Path("/proc/stat").read_text()
        except OSError:
            return None
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:
            return None
    ticks = 0
    for line in text.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        # user nice system idle iowait irq softirq steal (guest time is already inside user)
        values = [int(v) for v in fields[:8]] + [0] * (8 - len(fields[:8]))
        ticks += sum(values) - values[3] - values[4] - (0 if count_niced else values[1])
    return ticks / os.sysconf("SC_CLK_TCK")


def others(busy: float, ours: float, wall: float) -> float:
    """Cores other processes kept busy: all busy time on our cores less our own, per second."""
    return max(0.0, (busy - ours) / wall) if wall > 0 else 0.0


def other_load(seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores other processes keep busy on ours, watched for `seconds` (None without /proc/stat)."""
    busy, cpu, t0 = busy_seconds(), time.process_time(), time.perf_counter()
    if busy is None:
        return None
    time.sleep(seconds)
    after, ours, wall = busy_seconds(), time.process_time() - cpu, time.perf_counter() - t0
    return None if after is None else others(after - busy, ours, wall)


def judge(
    cpu_share: float | None, other: float | None, threads: int, cores: int, on_cpu: bool = True
) -> str | None:
    """None when the machine let the run have its cores, else a warning naming the numbers and what to
    do. On an accelerator the timed work is not on these cores: no verdict."""
    if not on_cpu:
        return None
    problems = []
    if cpu_share is not None and cpu_share < MIN_CPU_SHARE:
        problems.append(f"this process got {cpu_share:.0%} of the {threads} core(s) it used")
    contention = None if other is None else other - (cores - threads)
    if contention is not None and contention >= MAX_CONTENTION:
        problems.append(
            f"other processes kept {other:.1f} of {cores} cores busy (we left them "
            f"{cores - threads})"
        )
    if not problems:
        return None
    fewer = f" or with fewer --threads (this run: {threads})" if threads > 1 else ""
    return (
        f"the machine was too busy for these speeds to mean much: {'; '.join(problems)}. Rerun on a "
        f"quiet machine{fewer}"
    )


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


class Meter:
    """What this process got while it timed something: started on creation, read by `stop`. The
    readers are arguments so that tests can feed it measurements."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.process_time,
        busy: Callable[[], float | None] = busy_seconds,
    ):
        self.clock, self.cpu, self.busy = clock, cpu, busy
        self.start = (clock(), cpu(), busy(), _loadavg())

    def stop(self, threads: int, cores: int, on_cpu: bool = True) -> dict:
        """-> the "busy" record: the measured numbers, too_busy and the warning (None when fine)."""
        wall0, cpu0, busy0, load0 = self.start
        wall, cpu, busy = self.clock() - wall0, self.cpu() - cpu0, self.busy()
        share = cpu / (wall * threads) if wall > 0 else None
        other = others(busy - busy0, cpu, wall) if busy is not None and busy0 is not None else None
        warning = judge(share, other, threads, cores, on_cpu)
        return {
            "too_busy": warning is not None,
            "warning": warning,
            "cpu_share": None if share is None else round(share, 3),
            "other_load": None if other is None else round(other, 2),
            "threads": threads,
            "cores": cores,
            "seconds": round(wall, 2),
            "loadavg_1min": [load0, _loadavg()],  # the whole machine's, this process included
            "thresholds": {"min_cpu_share": MIN_CPU_SHARE, "max_contention": MAX_CONTENTION},
        }
