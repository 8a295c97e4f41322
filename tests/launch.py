"""Several `spec` commands in ONE torchrun launch: each of the two processes runs them in turn, as
`python -m spec_cli.cli ARGS` would, and every command joins and leaves the process group itself
(spec_cli/distributed.py). Interpreter start-up (torch, transformers), most of what a tiny command
costs, is paid once for all of them.

Each command rendezvouses on a store of its own, hosted by rank 0 on a free port it announces through
torchrun's store: a second process group formed on torchrun's store would find the first one's keys
there, and a rank could join the old group while the other waits for the new one.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.launch JOBS.json

Every launch also checks the process group as the GPU path makes it: made with a backend per device
type ("cpu:gloo" here, "cpu:gloo,cuda:nccl" on GPUs), and every collective spec_cli calls itself
given a tensor on a device the group serves (tests/test_process_group.py emulates the GPU side).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(jobs: list[list], folder: Path, timeout: float = 900, processes: int = 2) -> None:
    """Run `jobs` (argument lists of `spec`, or ["-m", MODULE, ARGS...] for a module's main(*ARGS)), in
    order, under `torchrun --nproc-per-node PROCESSES`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "jobs.json").write_text(json.dumps([[str(a) for a in job] for job in jobs]))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(processes),
            "--master-port",
            str(free_port()),
            "-m",
            "tests.launch",
            str(folder / "jobs.json"),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def check_collectives() -> None:
    """Wrap torch.distributed so that a group made without a device map, or a collective whose tensor's
    device the group does not serve, fails the command."""
    import torch.distributed as dist

    real_init = dist.init_process_group

    def init_process_group(*args, backend=None, **kwargs):
        assert backend and ":" in backend, (
            f"process group made with backend {backend!r}, not a device map"
        )
        return real_init(*args, backend=backend, **kwargs)

    dist.init_process_group = init_process_group
    for name in (
        "all_reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
    ):
        real = getattr(dist, name)

        def checked(tensor, *args, _real=real, _name=name, group=None, **kwargs):
            served = {
                d.type for d in (group or dist.distributed_c10d._get_default_group())._device_types
            }
            first = tensor[0] if isinstance(tensor, list) else tensor
            assert first.device.type in served, (
                f"{_name} of a {first.device.type} tensor on a group serving {served}"
            )
            return _real(tensor, *args, group=group, **kwargs)

        setattr(dist, name, checked)


def run_jobs(path: str) -> int:
    from datetime import timedelta

    from torch.distributed import TCPStore

    from spec_cli.cli import main

    check_collectives()
    launcher = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(minutes=5),
    )
    rank = int(os.environ["RANK"])
    for i, argv in enumerate(json.loads(Path(path).read_text())):
        if rank == 0:
            launcher.set(f"tests.launch/{i}", str(free_port()))
        os.environ["MASTER_PORT"] = launcher.get(f"tests.launch/{i}").decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts this command's store
        if argv[0] == "-m":  # a module of the tests' own, run like `python -m MODULE ARGS`
            import importlib

            importlib.import_module(argv[1]).main(*argv[2:])
            code = 0
        else:
            code = main(argv)
        if code != 0:
            print(f"`spec {' '.join(argv)}` exited {code}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(run_jobs(sys.argv[1]))
