"""The engine in the loop's worker process as the trainer sees it (rank 0): its config, its pipe,
its answers, and RUN/best.

`spec train --eval-engine` starts one worker (`python -m spec_cli.stages.engine_worker CONFIG`: it
runs `spec export`'s path and `spec eval`'s decode loop, so its code sits among the stages) and
keeps it for the run. `EngineEvaluator` writes the worker's `WorkerConfig` (JSON), hands it a
checkpoint a line on its stdin, reads its answers from a pipe ($SPEC_ENGINE_EVAL_FD) in a thread,
and stops it; the loop never waits for an answer but at its last step (`finish`, up to
`wait_limit`). With --keep best, `BestKeeper` makes the checkpoint the engine measured best
RUN/best.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts.io import atomic_dir_from, write_json

WORKER_LOG = "worker.log"
BACKLOG = (
    2  # evaluations handed to the worker and not answered; past it a step's evaluation is skipped
)
RESULT_FD = "SPEC_ENGINE_EVAL_FD"  # the worker writes its answers to this file descriptor
PARENT_PID = "SPEC_ENGINE_EVAL_PARENT"  # the trainer's pid: the worker ends itself when it is gone
# torchrun's variables: the worker is one process of its own, not a rank of the trainer's group
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


@dataclass
class WorkerConfig:
    """What the worker process is started with (JSON in a file it is given)."""

    run_dir: str
    engine: str  # vllm | torch
    target: str  # the target folder the engine runs
    prompts: str  # a chat data file or mt-bench
    depth: int  # draft tokens per target forward (a chain)
    max_new_tokens: int
    num_prompts: int | None  # a given prompts file: this many, spread over its categories
    export_format: str  # the algorithm's vLLM format (the torch engine reads it back the same way)
    device: str | None = None
    dtype: str | None = None
    memory: float | None = (
        None  # on a GPU: the share of its memory the worker's engines take together
    )
    threads: int = 1  # intra-op threads on a CPU
    chat_template: str | None = None


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / ckpt.ENGINE_EVAL / f"step-{step:08d}"


class EngineEvaluator:
    """The worker process (started once, rank 0; started again once if it dies), the evaluations in
    flight, and what comes back: `submit` a checkpoint, `poll` for answers (never waits), `finish` waits
    for all (up to a timeout, then the worker is stopped)."""

    # the worker, given its config's path
    command = (sys.executable, "-m", "spec_cli.stages.engine_worker")

    def __init__(
        self,
        config: WorkerConfig,
        keep_best: bool,
        on_result,
        env: dict | None = None,
        signature: dict | None = None,
        warn=None,
    ):
        """on_result(record) is called (in the trainer's thread, from poll/finish) for every answer, with
        `best` set when it became RUN/best; `signature`: what the measurements are comparable under (engine,
        prompts, depth, tokens), kept in best.json; `warn(text)`: a line about the engine process."""
        self.config, self.keep_best, self.on_result = config, keep_best, on_result
        self.run_dir = Path(config.run_dir)
        self.folder = self.run_dir / ckpt.ENGINE_EVAL
        self.best = BestKeeper(self.run_dir, signature)
        self.pending: dict[int, float] = {}  # step -> when it was handed over
        self.answers: list[dict] = []  # come back, not yet handled
        self.done: list[dict] = []  # handled: the records logged
        self.busy: list[tuple[float, float]] = []  # (start, end) of each answered evaluation
        self.lock = threading.Lock()
        self.dead: str | None = None  # why the worker ended, while it is down
        self._said: str | None = None  # the death already warned about
        self.starts = 0
        self.process = None
        self.env = env
        self.warn = warn or (lambda text: None)
        self.seconds: list[float] = []  # how long each evaluation took in the worker

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        config_path = self.folder / "worker.json"
        write_json(config_path, asdict(self.config))
        read, write = os.pipe()
        env = dict(os.environ if self.env is None else self.env)
        for name in TORCHRUN_ENV:
            env.pop(name, None)
        env[RESULT_FD] = str(write)
        env[PARENT_PID] = str(os.getpid())  # the worker ends itself when this process is gone
        log = open(self.folder / WORKER_LOG, "ab")
        try:
            process = subprocess.Popen(
                [*self.command, str(config_path)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write,),
                env=env,
                start_new_session=True,
            )
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
            log.close()
        self.process, self.dead, self._said = process, None, None
        self.starts += 1
        self.reader = threading.Thread(
            target=self._read, args=(read, process), daemon=True, name="engine-eval"
        )
        self.reader.start()

    def _read(self, fd: int, process) -> None:
        with os.fdopen(fd, "r", encoding="utf-8") as answers:
            for line in answers:
                try:
                    answer = json.loads(line)
                except ValueError:
                    continue
                if isinstance(answer, dict) and isinstance(answer.get("step"), int):
                    with self.lock:
                        self.answers.append(answer)
        code = (
            process.wait()
        )  # the pipe closed: the worker is ending (outside the lock: it may take a while)
        with self.lock:
            self.dead = (
                f"the engine process ended (exit {code}); its log: {self.folder / WORKER_LOG}"
            )

    def ready(self) -> bool:
        """Whether a new evaluation can be handed over now (the worker alive, its backlog short). A worker
        that died is started again, once."""
        if (
            self.dead is not None
            and not self.pending
            and self.starts < 2
            and self.process is not None
        ):
            self.warn(f"{self.dead}: starting it again")
            self.start()
        return self.dead is None and self.process is not None and len(self.pending) < BACKLOG

    def submit(self, step: int, checkpoint: Path) -> None:
        self.pending[step] = time.perf_counter()
        try:
            self.process.stdin.write(
                (json.dumps({"step": step, "checkpoint": str(checkpoint)}) + "\n").encode()
            )
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the reader sees the end and says why

    def poll(self) -> list[dict]:
        """The answers that came back since the last call, handled (logged, RUN/best kept); when the worker
        died, a record saying so for each evaluation that was in flight (and a line, once, when none was)."""
        with self.lock:
            answers, self.answers = self.answers, []
            dead = self.dead
        done = [self._handle(a) for a in answers]
        if dead is not None:
            if self.pending:
                done += [
                    self._handle({"step": step, "error": dead}) for step in sorted(self.pending)
                ]
            elif dead != self._said:
                self.warn(
                    dead + ("" if self.starts < 2 else "; no more engine evaluations in this run")
                )
            self._said = dead
        return done

    def finish(self, timeout: float = None) -> list[dict]:
        """Wait until every evaluation handed over has come back (or the worker died), handling them; past
        `timeout` seconds (default SPEC_ENGINE_EVAL_TIMEOUT, 1 h) the worker is stopped and what it had is
        logged as not evaluated."""
        timeout = wait_limit() if timeout is None else timeout
        done, start = [], time.perf_counter()
        while self.pending:
            done += self.poll()
            if not self.pending:
                break
            if time.perf_counter() - start > timeout:
                self.warn(
                    f"the engine took over {timeout:.0f} s for step(s) {sorted(self.pending)}: stopping it "
                    "(SPEC_ENGINE_EVAL_TIMEOUT sets the limit)"
                )
                self.stop(hurry=True)
                with self.lock:
                    self.dead = self.dead or f"stopped after {timeout:.0f} s"
                self.starts = 2  # not started again
                done += self.poll()
                break
            time.sleep(0.2)
        return done

    def busy_share(self, start: float, end: float) -> float:
        """The share of [start, end] during which an evaluation was in flight."""
        spans = list(self.busy) + [(t, end) for t in self.pending.values()]
        covered, last = 0.0, start
        for a, b in sorted(spans):
            a, b = max(a, last), min(b, end)
            if b > a:
                covered += b - a
                last = b
        return covered / (end - start) if end > start else 0.0

    def _handle(self, answer: dict) -> dict:
        step = int(answer["step"])
        started = self.pending.pop(step, None)
        if started is not None:
            self.busy.append((started, time.perf_counter()))
        snapshot = step_dir(self.run_dir, step) / "checkpoint"
        record = {
            "split": "engine",
            "step": step,
            **{k: v for k, v in answer.items() if k != "step"},
        }
        try:
            if "error" not in record:
                self.seconds.append(float(record.get("seconds", 0.0)))
                if self.keep_best:
                    record["best"] = self.best.consider(record, snapshot)
            shutil.rmtree(snapshot, ignore_errors=True)  # kept as RUN/best (moved) or not needed
            self.done.append(record)
            self.on_result(record)
        except Exception as exc:  # noqa: BLE001 (a full disk, say: training goes on, and says so)
            self.warn(
                f"engine @ {step}: its answer could not be kept ({type(exc).__name__}: {exc})"
            )
        return record

    def stop(self, hurry: bool = False) -> None:
        """End the worker: asked to stop (given 30 s, or 3 with `hurry`), then killed with its process group."""
        import signal

        process, self.process = self.process, None
        if process is None:
            return
        try:
            try:
                process.stdin.write(b'{"stop": true}\n')
                process.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
            if hurry:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=3 if hurry else 30)
        except BaseException:  # a timeout, or a second Ctrl-C while waiting: it goes now
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                process.kill()
            process.wait()

    def close(self, hurry: bool = False) -> None:
        """Stop the worker, handle what it answered meanwhile, and drop the snapshots it never answered."""
        self.stop(hurry)
        with contextlib.suppress(Exception):
            self.reader.join(timeout=5)
        with self.lock:
            answers, self.answers = self.answers, []
        for answer in answers:
            self._handle(answer)
        for step in list(self.pending):
            shutil.rmtree(step_dir(self.run_dir, step) / "checkpoint", ignore_errors=True)


def wait_limit() -> float:
    """How long the trainer waits for the engine (SPEC_ENGINE_EVAL_TIMEOUT seconds, default 1 h)."""
    try:
        return max(1.0, float(os.environ.get("SPEC_ENGINE_EVAL_TIMEOUT", "3600")))
    except ValueError:
        return 3600.0


class BestKeeper:
    """RUN/best: the checkpoint with the best acceptance length so far (ties: the later step) and its
    best.json; read back on --resume."""

    def __init__(self, run_dir: Path, signature: dict | None = None):
        """signature: what the run measures under (engine, prompts, depth, tokens a turn). A RUN/best
        measured under another (a resume that changed --eval-engine, say) is not compared with: the
        first new answer replaces it."""
        self.run_dir = Path(run_dir)
        self.signature = signature
        self.record = ckpt.best_record(self.run_dir)
        self.comparable = self.record is not None and (
            signature is None or self.record.get("signature") == signature
        )

    def consider(self, result: dict, snapshot: Path) -> bool:
        """Make `snapshot` (the evaluated step's weights) RUN/best when it accepts at least as well as
        the best so far; True when it did."""
        best = self.record if self.comparable else None
        if best is not None and (result["acceptance_length"], result["step"]) < (
            best["acceptance_length"],
            best["step"],
        ):
            return False
        if not (snapshot / "model.safetensors").is_file():
            return False
        record = {
            "step": result["step"],
            "engine": result["engine"],
            "acceptance_length": result["acceptance_length"],
            "acceptance_rate": result.get("acceptance_rate"),
            "speedup": result.get("speedup"),
            "depth": result.get("depth"),
            "prompts": result.get("prompts"),
            "turns": result.get("turns"),
            "signature": self.signature,
            "before": None
            if self.record is None
            else {
                "step": self.record["step"],
                "acceptance_length": self.record["acceptance_length"],
                "comparable": self.comparable,
            },
        }
        staged = Path(tempfile.mkdtemp(prefix=f".{ckpt.BEST}.", suffix=".tmp", dir=self.run_dir))
        try:
            for item in snapshot.iterdir():
                shutil.move(str(item), staged / item.name)
            (staged / ckpt.BEST_JSON).write_text(
                json.dumps(record, indent=2, sort_keys=True) + "\n"
            )
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        with atomic_dir_from(staged, self.run_dir / ckpt.BEST):
            pass
        self.record, self.comparable = record, True
        return True
