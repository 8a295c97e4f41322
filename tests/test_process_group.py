"""The process group on the CUDA path, emulated on CPU: what `distributed.init` asks torch for on a GPU
rank (the backend per device type, the device binding, the timeout), and every collective spec_cli
runs itself handed a tensor on a device that group serves. The compute tensors are fake CUDA tensors
(FakeTensorMode: CUDA device, no GPU); torch.distributed is replaced by a recorder that refuses what
NCCL refuses. The NCCL-only group spec_cli used to make fails these same checks (the last test).
Also: a rank waiting for rank 0's solo work fails with one line at its timeout, not a hang."""

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from spec_cli import distributed, threads
from spec_cli.errors import ConfigError
from spec_cli.trainer.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]


class RecordedGroup:
    """torch.distributed as a GPU rank of a 2-process job sees it: init's arguments are recorded, and
    a collective on a tensor whose device the group's backend does not serve raises as NCCL does."""

    def __init__(self, monkeypatch, rank=1, gpus=2):
        self.init_kwargs, self.bound, self.collectives = None, [], []
        self.rank, self.gpus = rank, gpus
        for key, value in {
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
        }.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("SPEC_DIST_TIMEOUT", raising=False)
        monkeypatch.setattr(dist, "is_initialized", lambda: self.init_kwargs is not None)
        monkeypatch.setattr(dist, "init_process_group", self.init_process_group)
        monkeypatch.setattr(dist, "new_group", lambda **kw: ("gloo group", kw))
        monkeypatch.setattr(dist, "get_rank", lambda group=None: self.rank)
        monkeypatch.setattr(
            dist, "all_reduce", lambda t, op=None, group=None: self.check("all_reduce", t)
        )
        monkeypatch.setattr(
            dist, "barrier", lambda group=None: self.check("barrier", torch.zeros(1))
        )
        monkeypatch.setattr(dist, "gather_object", self.gather_object)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.gpus)
        monkeypatch.setattr(torch.cuda, "set_device", self.bound.append)

    def init_process_group(self, **kwargs):
        assert self.init_kwargs is None, "joined twice"
        self.init_kwargs = kwargs

    @property
    def served(self) -> set[str]:
        return distributed.served_device_types(self.init_kwargs["backend"])

    def check(self, op, tensor):
        if (
            tensor.device.type not in self.served
        ):  # NCCL: "No backend type associated with device type cpu"
            raise RuntimeError(
                f"{op}: no backend for device type {tensor.device.type} in "
                f"{self.init_kwargs['backend']!r}"
            )
        self.collectives.append((op, tensor.device.type))

    def gather_object(self, obj, out, dst=0):
        # torch sends objects from the host when the group serves "cpu" (else from the current GPU)
        self.check(
            "gather_object", torch.zeros(1, device="cpu" if "cpu" in self.served else "cuda")
        )
        if out is not None:
            out[:] = [obj] * len(out)


def objective_output(device, k=3):
    """What the objective returns per micro-batch (on the compute device)."""

    class Out:
        loss = torch.rand((), device=device)
        step_loss = torch.rand(k, device=device)
        correct = torch.randint(0, 9, (k,), device=device).float()
        total = torch.full((k,), 9.0, device=device)

    return Out()


def test_a_gpu_rank_binds_its_gpu_and_joins_one_group_with_a_backend_per_device(monkeypatch):
    group = RecordedGroup(monkeypatch, rank=1)
    device = distributed.local_device(torch.device("cuda"))
    distributed.init(device)
    assert device == torch.device("cuda", 1) and group.bound == [device]
    kw = group.init_kwargs
    assert kw["backend"] == "cpu:gloo,cuda:nccl" and kw["device_id"] == device
    assert kw["timeout"] == timedelta(seconds=distributed.DEFAULT_TIMEOUT_S)
    assert group.served == {"cpu", "cuda"}


def test_every_collective_of_a_training_step_is_served_on_the_gpu_path(monkeypatch):
    group = RecordedGroup(monkeypatch)
    device = distributed.local_device(torch.device("cuda"))
    distributed.init(device)
    with FakeTensorMode():  # CUDA tensors without a GPU
        window = Metrics(3, device)  # the sums stay on the compute device between log steps
        for _ in range(2):
            window.add(objective_output(device), tokens=100)
        window.all_reduce()  # the log step's sums
    assert distributed.any_rank(False) is False  # --max-time: out of time on any rank?
    assert (
        distributed.gather_to_main({0: {"file": "shard-00000"}}) is None
    )  # precompute's shard entries
    distributed.barrier()
    assert group.collectives == [
        ("all_reduce", "cuda"),
        ("all_reduce", "cpu"),
        ("gather_object", "cpu"),
        ("barrier", "cpu"),
    ]


def test_the_nccl_only_group_of_old_fails_these_checks(monkeypatch):
    """The mistake the checks exist for: an NCCL-only group, and host tensors reach it (the metrics'
    sums were host tensors then; the flags and barriers still are)."""
    group = RecordedGroup(monkeypatch)
    monkeypatch.setattr(
        distributed, "backend_for", lambda d: "nccl" if d.type == "cuda" else "gloo"
    )
    distributed.init(distributed.local_device(torch.device("cuda")))
    with FakeTensorMode():
        window = Metrics(3)  # on the host, as they were
        window.add(objective_output(torch.device("cpu")), tokens=100)
        with pytest.raises(RuntimeError, match="device type cpu"):
            window.all_reduce()
    with pytest.raises(RuntimeError, match="device type cpu"):
        distributed.any_rank(True)
    with pytest.raises(RuntimeError, match="device type cpu"):
        distributed.barrier()
    assert group.served == {"cuda"}


def test_cpu_ranks_use_a_device_map_too():
    assert distributed.backend_for(torch.device("cpu")) == "cpu:gloo"
    assert distributed.served_device_types("cpu:gloo") == {"cpu"}


@pytest.mark.parametrize(
    "local_rank, gpus, device, message",
    [
        (1, 2, "cuda:0", "would put all 2 ranks of this machine on GPU 0"),
        (3, 2, "cuda", "LOCAL_RANK 3 has no GPU: this machine shows 2"),
    ],
)
def test_a_rank_without_its_own_gpu_is_one_error(monkeypatch, local_rank, gpus, device, message):
    RecordedGroup(monkeypatch, rank=local_rank, gpus=gpus)
    with pytest.raises(ConfigError, match=message):
        distributed.local_device(torch.device(device))


def test_a_bad_timeout_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("SPEC_DIST_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="SPEC_DIST_TIMEOUT='soon'"):
        distributed.timeout_s()
    monkeypatch.setenv("SPEC_DIST_TIMEOUT", "90")
    assert distributed.timeout_s() == 90.0


def test_ranks_share_the_machines_cores(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 96)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    choice = threads.choose_for_run()
    assert choice.threads == 12 and "shared by the 8 ranks" in choice.reason
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun sets when it launches several
    assert threads.choose_for_run().threads == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "other_load", lambda: 0.0)
    assert threads.choose_for_run().threads == 96


WAITER = textwrap.dedent("""
    import os, sys, time
    from spec_cli import distributed
    from spec_cli.errors import TrainingError
    distributed.init()
    if distributed.is_main():
        time.sleep(30)  # rank 0 "tokenising" longer than the others may wait
        sys.exit(0)
    try:
        distributed.wait_for_main("tokenising the data", seconds=1)
    except TrainingError as exc:
        print(exc.one_line(), flush=True)
        os._exit(3)  # rank 0 is still busy: no goodbye to the group
""")


def test_a_rank_waiting_for_rank_0_gives_up_with_one_line_at_its_timeout(tmp_path):
    """Two gloo processes: rank 1 waits (SPEC_DIST_TIMEOUT=2 s) for a rank 0 that takes 30 s."""
    from tests.launch import free_port

    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "SPEC_DIST_TIMEOUT": "2",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WAITER],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        out, err = procs[1].communicate(timeout=25)  # well before rank 0 is done: no hang
    finally:
        procs[0].kill()
        procs[0].wait()
    assert procs[1].returncode == 3, err[-2000:]
    assert "rank 1 waited 2 s for the other ranks to finish tokenising the data" in out
    assert (
        "SPEC_DIST_TIMEOUT" in out
        and "waiting for rank 0 to finish tokenising the data" in out + err
    )


SHARED = textwrap.dedent("""
    import sys
    from spec_cli import distributed
    from spec_cli.errors import ConfigError
    distributed.init()
    try:  # each rank its own folder: nodes that write their own disks
        distributed.check_shared_folder(sys.argv[1 + distributed.rank()], "the run folder")
        said, code = "shared", 0
    except ConfigError as exc:
        said, code = exc.one_line(), 3
    distributed.barrier()  # leave the group together (a rank exiting first can abort the other's gloo)
    distributed.shutdown()
    print(said)
    sys.exit(code)
""")


def two_ranks(script: str, *args, timeout: float = 60) -> list[tuple[int, str, str]]:
    """Run `script` as two gloo ranks on this machine; [(exit code, stdout, stderr)] by rank."""
    from tests.launch import free_port

    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *map(str, args)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, *o) for p, o in zip(procs, outputs)]
    finally:
        for p in procs:
            p.kill()


def test_ranks_that_do_not_share_the_run_folder_fail_at_once_on_every_rank(tmp_path):
    results = two_ranks(SHARED, tmp_path / "node0" / "run", tmp_path / "node1" / "run")
    for code, out, err in results:
        assert code == 3, err[-2000:]
        assert (
            "rank 1 on" in out and "cannot see the run folder" in out and "every node mounts" in out
        )
    assert list((tmp_path / "node0" / "run").iterdir()) == []  # the token is gone
    same = two_ranks(SHARED, tmp_path / "run", tmp_path / "run")
    assert [(code, out.strip()) for code, out, _ in same] == [(0, "shared"), (0, "shared")]
