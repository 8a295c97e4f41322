"""Several `spec` commands in ONE torchrun launch: each of the two processes runs them in turn, as
`python -m spec_cli.cli ARGS` would, and every command joins and leaves the process group itself
(spec_cli/distributed.py). Interpreter start-up (torch, transformers), most of what a tiny command
costs, is paid once for all of them.

Each command rendezvouses on a store of its own, hosted by rank 0 on a free port it announces through
torchrun's store: a second process group formed on torchrun's store would find the first one's keys
there, and a rank could join the old group while the other waits for the new one.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.launch JOBS.json
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


def torchrun(jobs: list[list], folder: Path, timeout: float = 900) -> None:
    """Run `jobs` (argument lists of `spec`), in order, under `torchrun --nproc-per-node 2`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "jobs.json").write_text(json.dumps([[str(a) for a in job] for job in jobs]))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "tests.launch", str(folder / "jobs.json")],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def run_jobs(path: str) -> int:
    from datetime import timedelta

    from torch.distributed import TCPStore

    from spec_cli.cli import main

    launcher = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(minutes=5))
    rank = int(os.environ["RANK"])
    for i, argv in enumerate(json.loads(Path(path).read_text())):
        if rank == 0:
            launcher.set(f"tests.launch/{i}", str(free_port()))
        os.environ["MASTER_PORT"] = launcher.get(f"tests.launch/{i}").decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts this command's store
        code = main(argv)
        if code != 0:
            print(f"`spec {' '.join(argv)}` exited {code}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(run_jobs(sys.argv[1]))
