"""`spec train --eval-engine vllm|torch`: the run's checkpoints decoded by a real engine while it trains.

Teacher-forced metrics keep rising after served acceptance has peaked (docs/recipe.md: MT-bench 1.55 at
2,000 steps, 1.49 at 4,000, held-out top-1 still rising). So every --eval-engine-every steps, and at the
last one, the trainer writes the current weights (RUN/engine-eval/step-N/checkpoint, weights only) and
hands the step to a worker process it started once (`python -m spec_cli.stages.engine_eval`). The worker
exports them through `spec export`'s own path, self-check included, and decodes the run's fixed prompts,
greedy, a chain of the run's depth, the target alone beside it on the same prompts (eval's decode loop).
Its engine loads once: vLLM takes each new export by its own in-place reload, PyTorch keeps its target.

Results come back on a pipe and are logged when they arrive (log.jsonl `split: "engine"`, the console,
training.png); the loop never waits for them, except at its last step, whose checkpoint is evaluated
before the run ends. With `--keep best` the checkpoint whose acceptance length was the best (ties: the
later step) is kept as RUN/best, which `spec export RUN` and `spec eval RUN` take by default; its
best.json carries what the engine measured, so a `--resume` keeps the record.

The prompts: --eval-prompts FILE, or the batches the run holds out from training (--eval-fraction):
--eval-engine-prompts of their conversations, first two user turns, written once to
RUN/engine-eval/prompts.jsonl (`spec eval --prompts` of that file gives the same numbers).
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
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts.io import atomic_dir_from, atomic_path, remove_temporaries, write_json
from spec_cli.console import info
from spec_cli.errors import ConfigError, DataError, SpecError

ENGINES = ("vllm", "torch")
PROMPTS = "prompts.jsonl"
WORKER_LOG = "worker.log"
BACKLOG = 2  # evaluations handed to the worker and not answered; past it a step's evaluation is skipped
RESULT_FD = "SPEC_ENGINE_EVAL_FD"  # the worker writes its answers to this file descriptor
PARENT_PID = "SPEC_ENGINE_EVAL_PARENT"  # the trainer's pid: the worker ends itself when it is gone
# torchrun's variables: the worker is one process of its own, not a rank of the trainer's group
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


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
    memory: float | None = None  # on a GPU: the share of its memory the worker's engines take together
    threads: int = 1  # intra-op threads on a CPU
    chat_template: str | None = None


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / ckpt.ENGINE_EVAL / f"step-{step:08d}"


# ----------------------------------------------------------------------------- before training

def check_available(engine: str, algorithm) -> None:
    """Refuse before anything is written: an engine that is not installed, an algorithm it cannot serve."""
    if engine == "vllm":
        from spec_cli.engine import vllm

        if not vllm.available():
            raise ConfigError("--eval-engine vllm needs vLLM, which is not installed",
                              f"{vllm.INSTALL_HINT}; or --eval-engine torch")
    if engine == "vllm" and (fmt := algorithm.engine_format("vllm")) is not None and vllm.cannot_run(fmt):
        raise ConfigError(f"--eval-engine vllm cannot run {algorithm.title} drafts here: {vllm.cannot_run(fmt)}",
                          "--eval-engine torch")
    if not any(f.engine == "vllm" for f in algorithm.formats):
        why = algorithm.not_served or "it has no export vLLM reads"
        raise ConfigError(f"--eval-engine decodes the run's export; {algorithm.title} drafts have none ({why})",
                          "evaluate its checkpoints with `spec eval` (PyTorch) after training")


def template_arg(source: str | None) -> str | None:
    """The --chat-template a recorded `chat_template_source` stands for (None: the target's own)."""
    if not source or source in ("the target's tokenizer", "none"):
        return None
    return source.removeprefix("family ").strip()


def eval_target(cfg, source) -> str:
    """The target the engine runs: --eval-engine-target, the run's --target, or its cache's."""
    rt = cfg.runtime
    if rt.eval_engine_target:
        return rt.eval_engine_target
    if cfg.data.target:
        return cfg.data.target
    if cfg.data.cache is not None:
        manifest = json.loads((Path(cfg.data.cache) / "manifest.json").read_text())
        if manifest.get("target") and Path(manifest["target"]).exists():
            return manifest["target"]
        raise ConfigError(f"--eval-engine runs the target, and the one the cache was made from "
                          f"({manifest.get('target')}) is not here", "pass --eval-engine-target FOLDER")
    raise ConfigError("--eval-engine runs the target on this machine; --remote serves it elsewhere",
                      "pass --eval-engine-target with a local copy of the target")


def write_prompts(run_dir: Path, chosen: list[dict]) -> Path:
    """RUN/engine-eval/prompts.jsonl: the held-out conversations, one JSON record a line (a file
    `spec eval --prompts` reads)."""
    path = Path(run_dir) / ckpt.ENGINE_EVAL / PROMPTS
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen), encoding="utf-8")
    return path


def visible_device(device) -> str:
    """CUDA_VISIBLE_DEVICES for the worker: the trainer's GPU, as the trainer's own variable numbers it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device.index or 0
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return ids[index] if index < len(ids) else str(index)
    return str(index)


def held_out_records(cfg, source, schedule) -> list[dict]:
    """--eval-engine-prompts conversations of the held-out batches (none of whose records the run trains
    on), a seeded choice in file order, as {"id", "source_index", "turns": first two user turns[,
    "system"]}."""
    import torch

    from spec_cli.data import records
    from spec_cli.eval.prompts import _user_turns

    hint = "pass --eval-prompts FILE (held-out chats or mt-bench), or keep --eval-fraction above 0"
    if not schedule.eval:
        raise ConfigError("--eval-engine decodes held-out conversations, and this run holds none out "
                          "(--eval-fraction 0, or too few batches)", hint)
    data = data_file(cfg)
    index = source.tokens.source_index
    trained = {int(index[i]) for batch in schedule.train for i in batch}
    held = sorted({int(index[i]) for batch in schedule.eval for i in batch} - trained)
    table = records.load_records(data)
    usable = []
    for i in held:
        record = table[i]
        if records.has_images(record):
            continue
        turns, system = _user_turns(record)
        if turns:
            usable.append({"id": f"heldout-{i}", "source_index": i, "turns": turns[:2],
                           **({"system": system} if system else {})})
    if not usable:
        raise DataError(f"the held-out batches of {data} have no text chat with a user turn", hint)
    count = min(cfg.runtime.eval_engine_prompts, len(usable))
    order = torch.randperm(len(usable), generator=torch.Generator().manual_seed(cfg.optim.seed + 104729))
    return [usable[i] for i in sorted(order[:count].tolist())]


def data_file(cfg) -> Path:
    """The chat data the run's samples were tokenised from: --data, or the file its cache records (it
    must be the same file: its fingerprint is checked)."""
    from spec_cli import assets
    from spec_cli.artifacts.io import sha256_path

    if cfg.data.cache is None:
        return Path(assets.resolve_data_arg(cfg.data.data))
    manifest = json.loads((Path(cfg.data.cache) / "manifest.json").read_text())
    path = Path(manifest.get("data") or "")
    hint = "pass --eval-prompts FILE (held-out chats or mt-bench)"
    if not manifest.get("data") or not path.is_file():
        raise ConfigError(f"the held-out conversations are read from the data the cache was made from "
                          f"({manifest.get('data')}), which is not here", hint)
    recorded = str(manifest.get("data_fingerprint", "")).split(":")[0]
    if recorded and sha256_path(path)[:len(recorded)] != recorded:
        raise ConfigError(f"{path} changed since the cache was made from it, so its held-out records cannot be "
                          "found", hint)
    return path


# ----------------------------------------------------------------------------- the trainer's side

class EngineEvaluator:
    """The worker process (started once, rank 0; started again once if it dies), the evaluations in
    flight, and what comes back: `submit` a checkpoint, `poll` for answers (never waits), `finish` waits
    for all (up to a timeout, then the worker is stopped)."""

    command = (sys.executable, "-m", "spec_cli.stages.engine_eval")  # the worker, given its config's path

    def __init__(self, config: WorkerConfig, keep_best: bool, on_result, env: dict | None = None,
                 signature: dict | None = None, warn=None):
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
            process = subprocess.Popen([*self.command, str(config_path)],
                                       stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                       pass_fds=(write,), env=env, start_new_session=True)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
            log.close()
        self.process, self.dead, self._said = process, None, None
        self.starts += 1
        self.reader = threading.Thread(target=self._read, args=(read, process), daemon=True, name="engine-eval")
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
        code = process.wait()  # the pipe closed: the worker is ending (outside the lock: it may take a while)
        with self.lock:
            self.dead = f"the engine process ended (exit {code}); its log: {self.folder / WORKER_LOG}"

    def ready(self) -> bool:
        """Whether a new evaluation can be handed over now (the worker alive, its backlog short). A worker
        that died is started again, once."""
        if self.dead is not None and not self.pending and self.starts < 2 and self.process is not None:
            self.warn(f"{self.dead}: starting it again")
            self.start()
        return self.dead is None and self.process is not None and len(self.pending) < BACKLOG

    def submit(self, step: int, checkpoint: Path) -> None:
        self.pending[step] = time.perf_counter()
        try:
            self.process.stdin.write((json.dumps({"step": step, "checkpoint": str(checkpoint)}) + "\n").encode())
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
                done += [self._handle({"step": step, "error": dead}) for step in sorted(self.pending)]
            elif dead != self._said:
                self.warn(dead + ("" if self.starts < 2 else "; no more engine evaluations in this run"))
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
                self.warn(f"the engine took over {timeout:.0f} s for step(s) {sorted(self.pending)}: stopping it "
                          "(SPEC_ENGINE_EVAL_TIMEOUT sets the limit)")
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
        record = {"split": "engine", "step": step, **{k: v for k, v in answer.items() if k != "step"}}
        try:
            if "error" not in record:
                self.seconds.append(float(record.get("seconds", 0.0)))
                if self.keep_best:
                    record["best"] = self.best.consider(record, snapshot)
            shutil.rmtree(snapshot, ignore_errors=True)  # kept as RUN/best (moved) or not needed
            self.done.append(record)
            self.on_result(record)
        except Exception as exc:  # noqa: BLE001 (a full disk, say: training goes on, and says so)
            self.warn(f"engine @ {step}: its answer could not be kept ({type(exc).__name__}: {exc})")
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


def remove_unanswered(run_dir: Path) -> None:
    """At a run's start: what an earlier, interrupted run left in RUN/engine-eval: snapshots it handed
    over and never heard back about, exports the worker did not finish, half-written files."""
    folder = Path(run_dir) / ckpt.ENGINE_EVAL
    if not folder.is_dir():
        return
    remove_temporaries(folder)
    for step in folder.glob("step-*"):
        for name in ("checkpoint", "export"):
            shutil.rmtree(step / name, ignore_errors=True)
        remove_temporaries(step)


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
        self.comparable = self.record is not None and (signature is None or self.record.get("signature") == signature)

    def consider(self, result: dict, snapshot: Path) -> bool:
        """Make `snapshot` (the evaluated step's weights) RUN/best when it accepts at least as well as
        the best so far; True when it did."""
        best = self.record if self.comparable else None
        if best is not None and (result["acceptance_length"], result["step"]) < (best["acceptance_length"], best["step"]):
            return False
        if not (snapshot / "model.safetensors").is_file():
            return False
        record = {"step": result["step"], "engine": result["engine"],
                  "acceptance_length": result["acceptance_length"],
                  "acceptance_rate": result.get("acceptance_rate"), "speedup": result.get("speedup"),
                  "depth": result.get("depth"), "prompts": result.get("prompts"), "turns": result.get("turns"),
                  "signature": self.signature,
                  "before": None if self.record is None else {"step": self.record["step"],
                                                              "acceptance_length": self.record["acceptance_length"],
                                                              "comparable": self.comparable}}
        staged = Path(tempfile.mkdtemp(prefix=f".{ckpt.BEST}.", suffix=".tmp", dir=self.run_dir))
        try:
            for item in snapshot.iterdir():
                shutil.move(str(item), staged / item.name)
            (staged / ckpt.BEST_JSON).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        with atomic_dir_from(staged, self.run_dir / ckpt.BEST):
            pass
        self.record, self.comparable = record, True
        return True


def clear_abandoned(run_dir: Path) -> None:
    """A new run (not --resume) in a folder without checkpoints (spec train refuses one with them): what
    an abandoned run there left of the engine in the loop is not this run's, and RUN/best would be
    exported in its place."""
    run_dir = Path(run_dir)
    found = [p for p in (run_dir / ckpt.BEST, run_dir / ckpt.ENGINE_EVAL) if p.exists()]
    if found:
        info(f"removing {', '.join(str(p) for p in found)}: left by an earlier run in this folder that saved no "
             "checkpoint")
        for path in found:
            shutil.rmtree(path, ignore_errors=True)


def prompts_digest(prompts: str, num_prompts: int | None) -> str:
    """What identifies the engine's prompts: the file's content (sha256, 16 hex) and how many are taken."""
    from spec_cli import assets
    from spec_cli.artifacts.io import sha256_path

    try:
        digest = sha256_path(Path(assets.resolve_data_arg(prompts)))[:16]
    except (OSError, SpecError):
        digest = str(prompts)
    return f"{digest}:{num_prompts}"


def recover_best(run_dir: Path) -> None:
    """A run killed between atomic_dir_from's two renames left RUN/.best.old and no RUN/best: put it back
    (before the run's start clears temporaries)."""
    best, old = Path(run_dir) / ckpt.BEST, Path(run_dir) / f".{ckpt.BEST}.old"
    if not best.exists() and (old / ckpt.BEST_JSON).is_file():
        os.replace(old, best)


def result_text(record: dict, depth: int) -> str:
    """One console line for an answer."""
    step = record["step"]
    if "error" in record:
        return f"engine @ {step}: not evaluated: {record['error']}"
    rates = " ".join("-" if r is None else f"{r:.2f}" for r in record.get("acceptance_rate") or [])
    best = "  (best so far: kept as RUN/best)" if record.get("best") else ""
    busy = f"  [{record['warning']}]" if record.get("warning") else ""
    return (f"engine @ {step} ({record['engine']}, chain {depth}, {record['turns']} turns, {record['seconds']:.0f} s): "
            f"accept len {record['acceptance_length']:.3f}  per position {rates}  speed-up "
            f"{record['speedup']:.2f}x{best}{busy}")


# ----------------------------------------------------------------------------- the worker process

class Worker:
    """The engine, loaded once; `evaluate(step, checkpoint)` exports and decodes one checkpoint."""

    def __init__(self, cfg: WorkerConfig):
        import torch

        from spec_cli.data import chat_templates
        from spec_cli.eval.speculative import eos_ids
        from spec_cli.targets import loading

        self.cfg = cfg
        self.target_dir = loading.resolve_target(cfg.target)
        self.target_config = loading.load_config(self.target_dir)
        self.template = chat_templates.resolve(cfg.chat_template)
        self.tokenizer = loading.load_tokenizer(self.target_dir, self.template)
        self.device = loading.choose_device(cfg.device)
        self.dtype = loading.choose_dtype(cfg.dtype, self.device)
        self.eos = eos_ids(self.tokenizer, loading.generation_config(self.target_dir)) | \
            chat_templates.end_of_turn_ids(self.tokenizer, self.template)
        if self.device.type == "cuda" and cfg.memory is not None and cfg.engine == "torch":
            torch.cuda.set_per_process_memory_fraction(cfg.memory, self.device)
        self.session = None

    def _session(self, algorithm: str, conversations):
        from spec_cli.eval.session import TorchSession, VllmSession

        if self.session is None:
            if self.cfg.engine == "vllm":
                share = None if self.cfg.memory is None or self.device.type != "cuda" else self.cfg.memory / 2
                self.session = VllmSession(self.target_dir, self.dtype, self.cfg.depth, algorithm, memory=share,
                                           max_model_len=self._context(conversations))
            else:
                self.session = TorchSession(self.target_dir, self.device, self.dtype)
        return self.session

    def _context(self, conversations) -> int:
        """vLLM's max_model_len: the longest conversation's prompt at its last turn, with every earlier
        answer as long as it may be, and the draft tokens; not the target's whole context (a 128k context
        would not fit the engine's KV cache beside training)."""
        from spec_cli.eval import prompts
        from spec_cli.targets import loading

        longest = 0
        for conv in conversations:
            last = len(conv.turns) - 1
            conv.answers = [""] * last
            longest = max(longest, len(prompts.prompt_ids(self.tokenizer, conv, last)) + last * self.cfg.max_new_tokens)
            conv.answers = []
        need = longest + self.cfg.max_new_tokens + self.cfg.depth + 64
        return min(loading.max_positions(self.target_config), need)

    def evaluate(self, step: int, checkpoint: Path) -> dict:
        start = time.perf_counter()
        folder = Path(checkpoint).parent
        export_dir = folder / "export"
        try:
            return self._evaluate(step, checkpoint, folder, export_dir, start)
        finally:  # the metrics are kept; the weights are in the snapshot
            shutil.rmtree(export_dir, ignore_errors=True)

    def _evaluate(self, step: int, checkpoint: Path, folder: Path, export_dir: Path, start: float) -> dict:
        from spec_cli import threads
        from spec_cli.eval import drafts, prompts
        from spec_cli.eval.speculative import Settings
        from spec_cli.stages import eval as evaluation
        from spec_cli.stages import export

        exported = export.run(export.ExportConfig(
            source=Path(checkpoint), format=self.cfg.export_format, output=export_dir, dtype="fp32", check=True,
            target=str(self.target_dir), engine_check="none", overwrite=True))
        export_seconds = time.perf_counter() - start
        loaded = drafts.load_draft(export_dir, self.target_config)
        drafts.check_target(loaded, self.target_dir, self.target_config, self.tokenizer, True, self.template)
        settings = Settings(depth=self.cfg.depth, topk=1, num_tokens=self.cfg.depth, temperature=0.0,
                            max_new_tokens=self.cfg.max_new_tokens, eos_ids=self.eos)
        conversations = prompts.load_conversations(self.cfg.prompts, self.cfg.num_prompts)
        session = self._session(loaded.model.config.algorithm, conversations)
        spec, base = session.decoders(export_dir if self.cfg.engine == "vllm" else loaded, settings)
        first = prompts.prompt_ids(self.tokenizer, conversations[0], 0)
        warm = replace(settings, max_new_tokens=min(evaluation.WARMUP_TOKENS, settings.max_new_tokens))
        spec(first, None, warm)
        base(first, None, warm)
        meter = threads.Meter()
        decoding = time.perf_counter()
        overall, _, _ = evaluation.decode_all(spec, base, self.tokenizer, conversations, settings, None,
                                              outputs=folder / "outputs.jsonl")
        used = __import__("torch").get_num_threads()
        busy = meter.stop(used, threads.available_cores(), on_cpu=self.device.type == "cpu")
        metrics = overall.metrics()
        seconds = time.perf_counter() - start
        write_json(folder / "eval.json", {
            "kind": "engine_eval", "step": step, "engine": session.info, "checkpoint": str(checkpoint),
            "export": {"format": exported.format, "self_check": exported.check is not None,
                       "seconds": round(export_seconds, 2)},
            "settings": {"depth": self.cfg.depth, "topk": 1, "temperature": 0.0, **session.decoding_rule(settings),
                         "max_new_tokens": self.cfg.max_new_tokens, "prompts": self.cfg.prompts,
                         "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
                         "threads": used},
            "overall": metrics, "busy": busy, "seconds": round(seconds, 2)})
        return {"engine": self.cfg.engine, "depth": self.cfg.depth, "prompts": self.cfg.prompts,
                "turns": metrics["turns"], "acceptance_length": metrics["acceptance_length"],
                "acceptance_rate": metrics["acceptance_rate"], "accepted": metrics["accepted"],
                "verified": metrics["verified"], "speedup": metrics["speedup"],
                "spec_tokens_per_s": metrics["spec_tokens_per_s"],
                "target_tokens_per_s": metrics["target_tokens_per_s"],
                "same_as_target": metrics["same_as_target"], "seconds": round(seconds, 2),
                "decode_seconds": round(time.perf_counter() - decoding, 2),
                "export_seconds": round(export_seconds, 2), "warning": busy.get("warning")}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def main(argv: list[str] | None = None) -> int:
    """The worker: one JSON request a line on stdin ({"step", "checkpoint"} or {"stop": true}), one
    answer a line on the file descriptor $SPEC_ENGINE_EVAL_FD; its own output goes to worker.log."""
    import torch

    argv = sys.argv[1:] if argv is None else argv
    cfg = WorkerConfig(**json.loads(Path(argv[0]).read_text()))
    _watch_parent(int(os.environ.get(PARENT_PID, "0") or 0))
    answers = os.fdopen(int(os.environ[RESULT_FD]), "w", buffering=1, encoding="utf-8")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(max(1, cfg.threads))
    from spec_cli.console import set_quiet

    set_quiet(True)
    worker = None
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            if request.get("stop"):
                break
            step = int(request["step"])
            try:
                worker = worker or Worker(cfg)
                answer = {"step": step, **worker.evaluate(step, Path(request["checkpoint"]))}
            except SpecError as exc:
                answer = {"step": step, "error": exc.message + (f" ({exc.hint})" if exc.hint else "")}
            except Exception as exc:  # noqa: BLE001 (a bug: its traceback goes to the log)
                traceback.print_exc()
                answer = {"step": step, "error": f"{type(exc).__name__}: {exc} (see {Path(cfg.run_dir) / ckpt.ENGINE_EVAL / WORKER_LOG})"}
            print(f"step {step}: {json.dumps(answer)}", flush=True)
            answers.write(json.dumps(answer) + "\n")
    finally:
        if worker is not None:
            worker.close()
        answers.close()
    return 0


def _watch_parent(parent: int) -> None:
    """End this process when the trainer that started it is gone (killed, say, with no chance to stop
    it): a worker left behind would hold its engine's memory and write into the run folder."""
    if parent <= 0:
        return

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


if __name__ == "__main__":
    sys.exit(main())
