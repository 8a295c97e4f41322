"""Signals at random moments never lose or corrupt work (issues 27 and 51).

    python bench/kill_resume.py [--kills 20] [--signals kill,term,term-kill] [--seed 0] [--keep DIR]

Builds a tiny random Llama target, chat data, a vocab map and a feature cache, then for each scenario
(a) `spec train --cache`, (b) `spec train --remote` against a `spec serve-target` on 127.0.0.1,
(c) `spec train --target` (the live target in process), (d) `spec train --cache` under torchrun x2 (gloo),
(e) `spec precompute` (several shards), does one straight run as the reference and then, N times per
signal kind: starts the command, signals it at a moment drawn uniformly in [0, the straight run's
duration], checks that the run folder's `.spec.lock` can be taken, and reruns (train: `--resume`;
precompute resumes by default) until it completes. The kinds: `kill` (SIGKILL), `term` (SIGTERM, what a
scheduler sends first: the command must exit by itself within --stop-grace), `term-kill` (SIGTERM, then
SIGKILL at a random moment of the grace period, as a scheduler does to a job that outlives it: a save
may be cut off). Each resumed result must equal the straight one (train: the final checkpoint's
model.safetensors bit for bit; precompute: every file of the cache byte for byte), the rerun must succeed
as is (no --no-resume, so no half-written file was trusted or refused) and leave no temporary files.
After `term`, no work may be lost beyond the step in flight: the checkpoint holds every step the log
held when the signal was sent (precompute: every shard written by then is kept). Prints a table; exits 1
on any failure.

tests/stages/test_kills.py imports this file (per scenario: one kill, then a kill of the resumed run); the
SIGTERM paths are tested in tests/test_cli_mistakes.py, tests/stages/test_data_mistakes.py,
tests/stages/test_regenerate.py and tests/test_distributed.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOKEN = "kill-resume"
TRAIN_OPTS = [
    "--ttt-steps",
    "3",
    "--lr",
    "3e-3",
    "--max-steps",
    "12",
    "--save-every",
    "4",
    "--keep-last",
    "2",
    "--log-every",
    "1",
    "--eval-every",
    "4",
    "--batch-tokens",
    "512",
    "--eval-fraction",
    "0.2",
    "--stop-grace",
    "10",
    "-q",
]
GRACE = 10.0  # --stop-grace above: how long a `term` trial waits for the command to exit by itself
PRECOMPUTE_OPTS = ["--batch-tokens", "512", "--shard-tokens", "600", "-q"]


def env_for(home: Path) -> dict:
    env = {
        **os.environ,
        "SPEC_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "SPEC_ENGINE_CHECK": "none",
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "200",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("SPEC_SERVE_TOKEN", None)
    env.pop("SPEC_TEST_SHARD_DELAY", None)
    return env


def spec(*args: str) -> list[str]:
    return [sys.executable, "-m", "spec_cli.cli", *map(str, args)]


def run_ok(cmd: list[str], env: dict) -> None:
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")


def make_setup(root: Path, samples: int = 48) -> dict:
    """Tiny target, data, vocab map and a feature cache under `root` (made through the CLI)."""
    from tests import tiny

    root.mkdir(parents=True, exist_ok=True)
    target = tiny.peaked_copy(
        tiny.save_tiny_target(root / "tiny-llama", "llama3", with_model=True), root / "peaky-llama"
    )
    rng = random.Random(11)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(tiny.random_sharegpt(rng)) + "\n" for _ in range(samples)))
    env = env_for(root / "home")
    vm, cache = root / "vm.safetensors", root / "cache"
    run_ok(
        spec(
            "build-vocab-map", "-t", target, "-d", data, "--draft-vocab-size", "96", "-o", vm, "-q"
        ),
        env,
    )
    run_ok(
        spec("precompute", "-t", target, "-d", data, "-v", vm, "-o", cache, *PRECOMPUTE_OPTS), env
    )
    return {"root": root, "target": target, "data": data, "vm": vm, "cache": cache, "env": env}


class Server:
    """`spec serve-target` on 127.0.0.1 (any free port) in a subprocess; its URL read from its output."""

    def __init__(self, setup: dict, startup_s: float = 120.0):
        self.proc = subprocess.Popen(
            spec(
                "serve-target",
                "-t",
                setup["target"],
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--token",
                TOKEN,
                "--dtype",
                "fp32",
                "--device",
                "cpu",
            ),
            env=setup["env"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        found = threading.Event()
        self.url: str | None = None

        def read():
            for line in self.proc.stdout:
                self.output.append(line)
                if self.url is None and (
                    m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
                ):
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(startup_s) or self.url is None:
            self.close()
            raise RuntimeError("spec serve-target did not start:\n" + "".join(self.output))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ----------------------------------------------------------------------------- comparing results


def train_result(run: Path) -> dict:
    """The final checkpoint's name and model tensors."""
    from safetensors.torch import load_file

    from spec_cli.artifacts import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(run)
    return {
        "checkpoint": None if latest is None else latest.name,
        "tensors": {} if latest is None else load_file(str(latest / "model.safetensors")),
    }


def same_train(a: Path, b: Path) -> str | None:
    import torch

    ra, rb = train_result(a), train_result(b)
    if ra["checkpoint"] != rb["checkpoint"]:
        return f"final checkpoint {rb['checkpoint']} != {ra['checkpoint']}"
    if ra["tensors"].keys() != rb["tensors"].keys():
        return "different tensor names"
    for k in ra["tensors"]:
        if not torch.equal(ra["tensors"][k], rb["tensors"][k]):
            return f"tensor {k} differs"
    return None


def digest(folder: Path) -> dict:
    """Every file of the folder by content (not the lock file: it names the process that held it)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".spec.lock"
    }


def same_cache(a: Path, b: Path) -> str | None:
    da, db = digest(a), digest(b)
    if da == db:
        return None
    extra, missing = sorted(set(db) - set(da)), sorted(set(da) - set(db))
    changed = sorted(k for k in set(da) & set(db) if da[k] != db[k])
    return f"files extra {extra[:3]} missing {missing[:3]} changed {changed[:3]}"


def leftovers(folder: Path) -> list[str]:
    """Temporary files a finished command left behind (a half-written file not cleaned up)."""
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and ("tmp" in p.name.lower() or p.name.endswith(".partial"))
    )


# ----------------------------------------------------------------------------- scenarios


def logged_steps(run: Path) -> int:
    """The last step `spec train` logged in `run` (--log-every 1: the steps finished)."""
    steps = [0]
    log = run / "log.jsonl"
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("split") == "train":
                steps.append(int(record["step"]))
    return max(steps)


def saved_steps(run: Path) -> int:
    from spec_cli.artifacts import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(run)
    return 0 if latest is None else int(latest.name.split("-")[1])


def train_kept(run: Path, logged: int) -> str | None:
    """After a SIGTERM: the checkpoint holds every step logged before the signal."""
    saved = saved_steps(run)
    return (
        None
        if saved >= logged
        else f"{logged - saved} finished step(s) lost (logged {logged}, saved {saved})"
    )


def shards_written(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("shard-*.json")}


def shards_kept(cache: Path, written: set[str]) -> str | None:
    lost = written - shards_written(cache)
    return None if not lost else f"shards lost: {sorted(lost)}"


@dataclass
class Scenario:
    name: str
    command: Callable[[Path, bool], list[str]]  # (output folder, resume) -> argv
    compare: Callable[
        [Path, Path], str | None
    ]  # (straight, resumed) -> None when equal, else why not
    env: dict
    progress: Callable[[Path], object] = (
        logged_steps  # what is finished now, read when the signal is sent
    )
    kept: Callable[[Path, object], str | None] = (
        train_kept  # after a SIGTERM: nothing finished was lost
    )
    group: bool = (
        False  # signal the whole process group (torchrun: the agent and its ranks, as Slurm does)
    )


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "spec_cli.cli",
        *map(str, args),
    ]


def scenarios(setup: dict, server_url: str | None, torchrun_too: bool = True) -> list[Scenario]:
    s = setup
    resuming = lambda resume: ["--resume"] if resume else []  # noqa: E731
    out = [
        Scenario(
            "train --cache",
            lambda o, resume: spec(
                "train",
                "--cache",
                s["cache"],
                "-v",
                s["vm"],
                "-o",
                o,
                *TRAIN_OPTS,
                *resuming(resume),
            ),
            same_train,
            s["env"],
        )
    ]
    if server_url is not None:
        out.append(
            Scenario(
                "train --remote",
                lambda o, resume: spec(
                    "train",
                    "--remote",
                    server_url,
                    "--token",
                    TOKEN,
                    "--data",
                    s["data"],
                    "-v",
                    s["vm"],
                    "-o",
                    o,
                    *TRAIN_OPTS,
                    *resuming(resume),
                ),
                same_train,
                s["env"],
            )
        )
    out.append(
        Scenario(
            "train --target",
            lambda o, resume: spec(
                "train",
                "--target",
                s["target"],
                "--data",
                s["data"],
                "-v",
                s["vm"],
                "--dtype",
                "fp32",
                "-o",
                o,
                *TRAIN_OPTS,
                *resuming(resume),
            ),
            same_train,
            s["env"],
        )
    )
    if torchrun_too:
        out.append(
            Scenario(
                "train --cache, torchrun x2",
                lambda o, resume: torchrun(
                    "train",
                    "--cache",
                    s["cache"],
                    "-v",
                    s["vm"],
                    "-o",
                    o,
                    *TRAIN_OPTS,
                    *resuming(resume),
                ),
                same_train,
                s["env"],
                group=True,
            )
        )
    out.append(
        Scenario(
            "precompute",
            lambda o, resume: spec(
                "precompute",
                "-t",
                s["target"],
                "-d",
                s["data"],
                "-v",
                s["vm"],
                "-o",
                o,
                *PRECOMPUTE_OPTS,
            ),
            same_cache,
            s["env"],
            progress=shards_written,
            kept=shards_kept,
        )
    )
    return out


@dataclass
class Trial:
    kill_at: float
    killed: bool = False  # False: the command finished before the signal's moment
    how: str = "kill"  # kill | term | term-kill
    lost: str | None = None  # term: what finished work the stop lost (None: nothing)
    stop_s: float | None = None  # term: seconds from SIGTERM to the exit
    code: int | None = None  # the first run's exit code (None: SIGKILLed)
    then_killed: list[bool] = field(
        default_factory=list
    )  # the resumed runs killed in turn (`then`)
    lock_ok: bool = True
    resumed_ok: bool = True
    equal: bool = True
    reruns: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def straight_run(sc: Scenario, out: Path) -> float:
    """The reference run; its duration in seconds (start of the process to its exit)."""
    t0 = time.perf_counter()
    run_ok(sc.command(out, False), sc.env)
    return time.perf_counter() - t0


def lock_free(folder: Path) -> str | None:
    """None when `folder`'s lock can be taken now (the killed process left it unlocked)."""
    from spec_cli.artifacts.guard import FolderLock

    if not folder.exists():
        return None
    try:
        with FolderLock(folder, "kill_resume check"):
            return None
    except Exception as exc:  # noqa: BLE001 - any failure to take it is the finding
        return f"lock not free after the kill: {exc}"


def new_files(out: Path) -> Callable[[], bool]:
    """A kill moment for a resumed run: true once `out` holds a file it did not hold when this was made
    (a checkpoint, a shard, or one being written), so the kill lands in its work whatever its speed."""
    before = {p for p in out.rglob("*") if p.is_file()}
    return lambda: any(p.is_file() and p not in before for p in out.rglob("*"))


def _killed_at(
    command: list[str],
    env: dict,
    kill_at: float | Callable[[], bool],
    timeout: float = 300.0,
    how: str = "kill",
    group: bool = False,
    progress: Callable[[], object] | None = None,
    rng: random.Random | None = None,
) -> tuple[bool, int | None, str, object, float | None]:
    """Run `command`, signal it `kill_at` s after its start (or once `kill_at()` is true): SIGKILL (`kill`),
    SIGTERM and a wait for its own exit (`term`; SIGKILL after GRACE + 30 s), or SIGTERM then SIGKILL at a
    random moment of the grace period (`term-kill`). (signalled, exit code if it ended first or by
    itself, stderr, `progress()` when the signal was sent, seconds from SIGTERM to the exit)."""
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=group,
    )

    def send(sig) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)

    signalled, before, stop_s = False, None, None
    try:
        if callable(kill_at):
            deadline = time.perf_counter() + timeout
            while proc.poll() is None and not kill_at():
                if time.perf_counter() > deadline:
                    raise subprocess.TimeoutExpired(command, timeout)
                time.sleep(0.01)
            if proc.poll() is None:
                raise subprocess.TimeoutExpired(command, 0)
        else:
            proc.wait(timeout=kill_at)
    except subprocess.TimeoutExpired:
        signalled = True
        before = progress() if progress is not None else None
        if how == "kill":
            send(signal.SIGKILL)
        else:
            sent = time.perf_counter()
            send(signal.SIGTERM)
            wait = GRACE + 30 if how == "term" else (rng or random).uniform(0, GRACE)
            try:
                proc.wait(timeout=wait)
                stop_s = time.perf_counter() - sent
            except subprocess.TimeoutExpired:
                send(signal.SIGKILL)
    if group:  # whatever the agent left (a rank it could not stop)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, err = proc.communicate()
    code = proc.returncode if (not signalled or stop_s is not None) else None
    return signalled, code, err, before, stop_s


def kill_trial(
    sc: Scenario,
    straight: Path,
    out: Path,
    kill_at: float,
    max_reruns: int = 3,
    timeout: float = 300.0,
    then: tuple = (),
    how: str = "kill",
    rng: random.Random | None = None,
) -> Trial:
    """Start the command in `out`, signal it (`how`) `kill_at` s later, rerun (resuming) until it completes;
    check the lock, the reruns and the result against `straight` (and after `term`, that nothing finished
    was lost). `then`: the resumed runs are SIGKILLed in turn (a kill of a run that was itself resuming),
    each that many seconds after its own start, or for `new_files`, once it wrote something; then a rerun
    must complete."""
    trial = Trial(kill_at, how=how)
    trial.killed, code, err, before, trial.stop_s = _killed_at(
        sc.command(out, False),
        sc.env,
        kill_at,
        how=how,
        group=sc.group,
        progress=lambda: sc.progress(out),
        rng=rng,
    )
    trial.code = code
    if not trial.killed and code != 0:
        trial.problems.append(f"the unsignalled first run failed ({code}): {err.strip()[-500:]}")
    if trial.killed and how == "term":
        if trial.stop_s is None:
            trial.problems.append(f"it did not exit within {GRACE + 30:g} s of SIGTERM")
        elif not sc.group and code not in (0, 143, -signal.SIGTERM):
            # 0: the signal came as its last step ended; -15 (a shell's 143 too): before spec_cli installed
            # its handler (the interpreter starting) or after the command returned, with nothing in flight
            trial.problems.append(f"SIGTERM: exit {code}, not 143: {err.strip()[-500:]}")
        if why := sc.kept(out, before):
            trial.lost = why
            trial.problems.append(f"SIGTERM lost finished work: {why}")
    if why := lock_free(out):
        trial.lock_ok = False
        trial.problems.append(why)
    done = not trial.killed and code == 0
    for at in then if trial.killed else ():
        moment = at(out) if callable(at) else at  # new_files: what the folder holds now
        killed, code, err, _, _ = _killed_at(sc.command(out, True), sc.env, moment, group=sc.group)
        trial.then_killed.append(killed)
        if why := lock_free(out):
            trial.lock_ok = False
            trial.problems.append(f"after the resumed run's kill: {why}")
        if not killed:  # it finished first
            done = code == 0
            if not done:
                trial.resumed_ok = False
                trial.problems.append(
                    f"the resumed run meant to be killed failed ({code}): {err.strip()[-500:]}"
                )
            break
    while not done and trial.reruns < max_reruns:
        trial.reruns += 1
        rerun = subprocess.run(
            sc.command(out, True),
            env=sc.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        done = rerun.returncode == 0
        if not done:
            trial.resumed_ok = False
            trial.problems.append(
                f"rerun {trial.reruns} exited {rerun.returncode}: "
                f"{(rerun.stdout + rerun.stderr).strip()[-800:]}"
            )
    if not done:
        trial.equal = False
        return trial
    if why := sc.compare(straight, out):
        trial.equal = False
        trial.problems.append(f"not equal to the straight run: {why}")
    if left := leftovers(out):
        trial.problems.append(f"temporary files left: {left[:5]}")
    return trial


@dataclass
class ScenarioReport:
    name: str
    straight_s: float
    trials: list[Trial]
    how: str = "kill"

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.trials)


def run_scenario(
    sc: Scenario,
    workdir: Path,
    kill_moments: Callable[[float], list[float]],
    keep: bool = False,
    kinds: tuple[str, ...] = ("kill",),
    rng: random.Random | None = None,
) -> list[ScenarioReport]:
    """The straight run, then per signal kind one trial per moment (`kill_moments(straight duration)`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    straight = workdir / "straight"
    duration = straight_run(sc, straight)
    reports = []
    for how in kinds:
        trials = []
        for i, at in enumerate(kill_moments(duration)):
            out = workdir / f"{how}-{i:03d}"
            trials.append(kill_trial(sc, straight, out, at, how=how, rng=rng))
            if not keep and trials[-1].ok:
                shutil.rmtree(out, ignore_errors=True)
        reports.append(ScenarioReport(sc.name, duration, trials, how))
    return reports


def table(reports: list[ScenarioReport]) -> str:
    rows = [
        (
            "scenario",
            "signal",
            "straight s",
            "signals",
            "landed",
            "lock free",
            "resumed OK",
            "equal",
            "nothing lost",
            "exit after SIGTERM (s)",
            "landed at (s)",
        )
    ]
    for r in reports:
        t = r.trials
        landed = sorted(x.kill_at for x in t if x.killed)
        stops = sorted(x.stop_s for x in t if x.stop_s is not None)
        rows.append(
            (
                r.name,
                r.how,
                f"{r.straight_s:.2f}",
                str(len(t)),
                str(len(landed)),
                f"{sum(x.lock_ok for x in t)}/{len(t)}",
                f"{sum(x.resumed_ok for x in t)}/{len(t)}",
                f"{sum(x.equal for x in t)}/{len(t)}",
                f"{sum(x.lost is None for x in t if x.killed)}/{len(landed)}"
                if r.how == "term"
                else "-",
                (
                    f"med {stops[len(stops) // 2]:.2f} max {stops[-1]:.2f}; exits "
                    + ",".join(
                        f"{c}x{n}"
                        for c, n in sorted(
                            Counter(x.code for x in t if x.stop_s is not None).items(),
                            key=lambda kv: str(kv[0]),
                        )
                    )
                )
                if stops
                else "-",
                (f"min {landed[0]:.2f} med {landed[len(landed) // 2]:.2f} max {landed[-1]:.2f}")
                if landed
                else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows
    ]
    lines.insert(1, "-" * max(map(len, lines)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--kills", type=int, default=20, help="signals per scenario and kind (default 20)"
    )
    ap.add_argument("--signals", default="kill,term,term-kill", help="kinds: kill, term, term-kill")
    ap.add_argument("--only", default="", help="run the scenarios whose name contains this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--keep", type=Path, help="work in this folder and keep it (default: a temporary one)"
    )
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.signals.split(",") if k)
    rng = random.Random(args.seed)
    root = args.keep or Path(tempfile.mkdtemp(prefix="kill_resume-"))
    t0 = time.perf_counter()
    try:
        setup = make_setup(root / "setup")
        print(f"setup in {time.perf_counter() - t0:.1f} s ({root})", flush=True)
        server = Server(setup)
        reports = []
        try:
            for i, sc in enumerate(scenarios(setup, server.url)):
                if args.only not in sc.name:
                    continue
                found = run_scenario(
                    sc,
                    root / f"scenario-{i}",
                    lambda d: [rng.uniform(0, d) for _ in range(args.kills)],
                    keep=args.keep is not None,
                    kinds=kinds,
                    rng=rng,
                )
                reports += found
                for report in found:
                    print(
                        f"{sc.name} [{report.how}]: straight {report.straight_s:.2f} s, {len(report.trials)} "
                        f"signals, {'ok' if report.ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s so far)",
                        flush=True,
                    )
        finally:
            server.close()
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(reports))
    failed = [(r.name, r.how, t) for r in reports for t in r.trials if not t.ok]
    for name, how, t in failed:
        print(f"\nFAILED {name} [{how}] at {t.kill_at:.2f} s:\n  " + "\n  ".join(t.problems))
    print(
        f"\n{'all ok' if not failed else f'{len(failed)} failed trial(s)'} in {time.perf_counter() - t0:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
