"""Target servers for tests: in a thread of the test process, or a real `serve()` subprocess.

Everything binds 127.0.0.1 on an ephemeral port; every wait is bounded.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from spec_cli.serve.http import HTTPHandle
from spec_cli.serve.run import tokenizer_files
from spec_cli.serve.server import Limits, TargetServer
from spec_cli.targets import loading
from spec_cli.targets.hf_backend import HFTargetBackend

ROOT = Path(__file__).resolve().parents[2]


def load_backend(target_dir: Path, aux_layers=None) -> HFTargetBackend:
    return HFTargetBackend(target_dir, aux_layers, device="cpu", dtype="fp32")


def start_server(
    backend,
    target_dir: Path,
    token: str | None = None,
    limits: Limits | None = None,
    request_timeout: float = 10.0,
    host: str = "127.0.0.1",
    **kw,
) -> HTTPHandle:
    """A TargetServer behind HTTP on `host`:<free port>, served from a background thread."""
    logic = TargetServer(
        backend,
        target_config=loading.load_config(target_dir).to_dict(),
        tokenizer_files=tokenizer_files(loading.load_tokenizer(target_dir)),
        token=token,
        limits=limits,
        **kw,
    )
    return HTTPHandle(logic, host, 0, request_timeout=request_timeout)


class ServerProcess:
    """`spec_cli.serve.run.serve(...)` in a subprocess; its URL is read from its output."""

    def __init__(
        self,
        target_dir: Path,
        token: str | None = None,
        startup_s: float = 60.0,
        code: str | None = None,
        **options,
    ):
        """`code`: a script to run instead (it serves sys.argv[1] itself)."""
        kwargs = ", ".join(
            f"{k}={v!r}"
            for k, v in {"port": 0, "device": "cpu", "dtype": "fp32", **options}.items()
        )
        code = (
            code
            or f"import sys; from spec_cli.serve.run import serve; serve(sys.argv[1], {kwargs})"
        )
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "COLUMNS": "200",
            "PYTHONPATH": str(ROOT),
        }
        env.pop("SPEC_SERVE_TOKEN", None)
        if token:
            env["SPEC_SERVE_TOKEN"] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(target_dir)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self.wait_for(r"listening on (http://127\.0\.0\.1:\d+)", startup_s).group(1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.output.append(line)
            if match := re.search(pattern, line):
                return match
        self.kill()
        raise AssertionError(f"server never printed {pattern!r}; output:\n{''.join(self.output)}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def random_batch(B: int = 3, T: int = 20, seed: int = 0, vocab: int = 400):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (B, T), generator=gen)
    am = torch.ones(B, T, dtype=torch.long)
    for b in range(1, B):
        am[b, T - 3 * b :] = 0
    lm = (torch.rand(B, T, generator=gen) < 0.6).long() * am
    return ids, am, lm


def draft_vocab(n: int = 64, seed: int = 0, vocab: int = 400) -> torch.Tensor:
    return torch.sort(
        torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n]
    ).values
