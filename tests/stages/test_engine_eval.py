"""spec train --eval-engine / --keep best: the engine in the training loop (here spec_cli's PyTorch decoder;
vLLM's: tests/engine/test_engine_loop.py). A run whose acceptance peaks early keeps the peak as RUN/best
(also across a stop and --resume), `spec export RUN` / `spec eval RUN` take it and say so, and the
in-loop numbers are what `spec eval` measures on the same prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.cli import main
from spec_cli.trainer import engine, engine_process
from spec_cli.trainer.trainer import Trainer
from tests import tiny

TOKENS = "16"
DAMAGE_FROM = 20  # the optimizer steps after this one run with the draft's lm_head negated


@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    """A peaked vLLM-sized tiny target (a draft learns it in 10 steps), 80 random chats, a vocab map of 64
    and a feature cache, through the CLI."""
    root = tmp_path_factory.mktemp("engine-loop")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        target = tiny.peaked_copy(tiny.save_vllm_sized_target(root / "raw"), root / "target")
        rng = random.Random(0)
        data = root / "data.jsonl"
        data.write_text("".join(json.dumps(tiny.random_sharegpt(rng)) + "\n" for _ in range(80)))
        vm, cache = root / "vm.safetensors", root / "cache"
        assert (
            main(
                [
                    "build-vocab-map",
                    "-t",
                    str(target),
                    "-d",
                    str(data),
                    "--draft-vocab-size",
                    "64",
                    "-o",
                    str(vm),
                    "-q",
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "precompute",
                    "-t",
                    str(target),
                    "-d",
                    str(data),
                    "-v",
                    str(vm),
                    "-o",
                    str(cache),
                    "--batch-tokens",
                    "512",
                    "-q",
                ]
            )
            == 0
        )
    finally:
        mp.undo()
    return {"root": root, "target": target, "data": data, "vm": vm, "cache": cache}


def train_args(sized, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--cache",
        str(sized["cache"]),
        "-v",
        str(sized["vm"]),
        "-o",
        str(out),
        "--max-steps",
        "30",
        "--lr",
        "1e-2",
        "--ttt-steps",
        "2",
        "--eval-fraction",
        "0.15",
        "--save-every",
        "10",
        "--keep-last",
        "10",
        "--log-every",
        "5",
        "--eval-engine",
        "torch",
        "--eval-engine-every",
        "5",
        "--eval-engine-wait",
        "--eval-engine-prompts",
        "4",
        "--eval-engine-tokens",
        TOKENS,
        "--keep",
        "best",
        "-q",
        *extra,
    ]


def engine_records(run: Path) -> list[dict]:
    return [
        r
        for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
        if r["split"] == "engine"
    ]


def damage_after(mp: pytest.MonkeyPatch, first: int, stop_at: int | None = None) -> dict:
    """Every optimizer step after `first` leaves the draft's lm_head negated (its proposals change
    entirely: what overfitting does to served acceptance, made certain); optionally a Ctrl-C at step
    `stop_at`. Returns the step counter (a resumed run sets it to where it continues)."""
    done, saved = {"step": 0}, {}
    real = Trainer.optimizer_step

    def damaging(self):
        norm = real(self)
        done["step"] += 1
        if done["step"] > first:
            head = self.draft.lm_head.weight
            saved.setdefault("head", head.detach().clone())
            with torch.no_grad():
                head.copy_(-saved["head"])
        if done["step"] == stop_at and not saved.get("stopped"):
            saved["stopped"] = True
            raise KeyboardInterrupt  # Ctrl-C: the finished steps are saved, the engine process stopped
        return norm

    mp.setattr(Trainer, "optimizer_step", damaging)
    return done


@pytest.fixture(scope="module")
def peaked_run(sized, tmp_path_factory):
    """A run whose acceptance peaks early (damage_after step 20), stopped by Ctrl-C at step 22 and resumed
    to step 30. Returns the run folder and the engine records of each part."""
    run = tmp_path_factory.mktemp("peaked") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(sized["root"] / "home"))
    done = damage_after(mp, DAMAGE_FROM, stop_at=22)
    try:
        assert main(train_args(sized, run)) == 130
        first = engine_records(run)
        done["step"] = (
            21  # the resumed run continues after step 22's optimizer step (21 done + the stopped one)
        )
        assert main(train_args(sized, run, "--resume")) == 0
    finally:
        mp.undo()
    return {"run": run, "first": first, "all": engine_records(run)}


def test_the_peak_is_kept_as_run_best_not_the_last(peaked_run):
    run, records = peaked_run["run"], peaked_run["all"]
    assert [r["step"] for r in records] == [
        5,
        10,
        15,
        20,
        25,
        30,
    ]  # --eval-engine-wait: none skipped
    assert all(r["engine"] == "torch" and r["turns"] > 0 and "error" not in r for r in records)
    by_step = {r["step"]: r["acceptance_length"] for r in records}
    assert (
        by_step[20] > 1.5 and max(by_step[25], by_step[30]) < by_step[20] - 0.3
    )  # it did peak early
    best_al = max(by_step.values())
    expected = max(s for s, al in by_step.items() if al == best_al)  # ties: the later step
    record = json.loads((run / ckpt.BEST / ckpt.BEST_JSON).read_text())
    assert record["step"] == expected and expected < 30
    assert record["acceptance_length"] == pytest.approx(best_al) and record["engine"] == "torch"
    # RUN/best holds that step's weights, exactly
    best = load_file(str(run / ckpt.BEST / "model.safetensors"))
    saved = load_file(str(run / ckpt.CHECKPOINTS / f"step-{expected:08d}" / "model.safetensors"))
    assert best.keys() == saved.keys() and all(torch.equal(best[k], saved[k]) for k in best)
    assert json.loads((run / ckpt.BEST / "trainer_state.json").read_text())["step"] == expected
    # marked in the log as it was kept; the snapshots handed to the engine are gone
    assert [r["step"] for r in records if r.get("best")][-1] == expected
    assert not list((run / ckpt.ENGINE_EVAL).glob("step-*/checkpoint"))
    assert (run / ckpt.ENGINE_EVAL / f"step-{expected:08d}" / "eval.json").is_file()


def test_a_resumed_run_keeps_the_best_so_far_record(peaked_run):
    """The first part (stopped at step 22) evaluated 5..20 and kept the best; the resumed part's
    evaluations (25, 30: damaged) did not replace it."""
    first, run = peaked_run["first"], peaked_run["run"]
    assert [r["step"] for r in first] == [5, 10, 15, 20]
    kept = [r for r in first if r.get("best")][-1]
    assert json.loads((run / ckpt.BEST / ckpt.BEST_JSON).read_text())["step"] == kept["step"]
    resumed = [r for r in peaked_run["all"] if r["step"] > 22]
    assert resumed and not any(r.get("best") for r in resumed)


def test_export_and_eval_of_the_run_take_the_best_and_say_so(peaked_run, sized, tmp_path, capsys):
    run = peaked_run["run"]
    best = json.loads((run / ckpt.BEST / ckpt.BEST_JSON).read_text())
    assert (
        main(
            [
                "export",
                str(run),
                "-f",
                "vllm",
                "-o",
                str(tmp_path / "export"),
                "--engine-check",
                "none",
            ]
        )
        == 0
    )
    said = " ".join(capsys.readouterr().out.split())
    assert f"kept its best checkpoint: taking {run / 'best'} (step {best['step']}" in said
    assert "the last checkpoint is step 30" in said
    assert (
        json.loads((tmp_path / "export" / "config.json").read_text())["spec_cli"]["step"]
        == best["step"]
    )
    # the in-loop numbers are spec eval's on the same prompts
    prompts = run / ckpt.ENGINE_EVAL / engine.PROMPTS
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "-t",
                str(sized["target"]),
                "--draft",
                str(run),
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                TOKENS,
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert "kept its best checkpoint" in capsys.readouterr().out
    separate = json.loads((out / "eval.json").read_text())
    in_loop = json.loads(
        (run / ckpt.ENGINE_EVAL / f"step-{best['step']:08d}" / "eval.json").read_text()
    )
    assert separate["draft"]["step"] == best["step"]
    for key in ("accepted", "verified", "turns", "same_as_target"):
        assert separate["overall"][key] == in_loop["overall"][key], key
    assert separate["overall"]["acceptance_length"] == pytest.approx(best["acceptance_length"])


def test_the_engine_decodes_held_out_conversations_chosen_once(peaked_run, sized):
    """The default prompts: conversations of the batches held out from training (none trained on), first
    two user turns, written once and decoded by every evaluation."""
    from spec_cli.artifacts.tokens import load_tokenized  # noqa: F401 (the cache's token table below)
    from spec_cli.targets.cache_backend import CacheBackend

    run = peaked_run["run"]
    chosen = [
        json.loads(line)
        for line in (run / ckpt.ENGINE_EVAL / engine.PROMPTS).read_text().splitlines()
    ]
    assert len(chosen) == 4 and all(1 <= len(r["turns"]) <= 2 for r in chosen)
    backend = CacheBackend(sized["cache"])
    tokens = backend.tokens()
    from spec_cli.trainer.sources import split_eval

    train_batches, held = split_eval(backend.plan(), 0.15, 0)
    trained = {int(tokens.source_index[i]) for b in train_batches for i in b}
    held_out = {int(tokens.source_index[i]) for b in held for i in b}
    assert {r["source_index"] for r in chosen} <= held_out - trained
    records = [json.loads(line) for line in sized["data"].read_text().splitlines()]
    for r in chosen:
        users = [
            m["value"] for m in records[r["source_index"]]["conversations"] if m["from"] == "human"
        ]
        assert r["turns"] == users[:2]
    turns = sum(len(r["turns"]) for r in chosen)
    assert all(r["turns"] == turns for r in peaked_run["all"])


def test_training_png_shows_the_engines_acceptance(peaked_run):
    import matplotlib.image

    from spec_cli.trainer.log import plot_curves

    path = plot_curves(peaked_run["run"])
    assert (
        matplotlib.image.imread(str(path)).shape[1] > 2000
    )  # four panels: the engine's is the fourth


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--keep", "best"],
            "--keep best keeps the checkpoint the engine measured best, and no --eval-engine",
        ),
        (["--eval-engine", "torch", "--eval-prompts", "EMPTY"], "no user turns found in"),
        (["--eval-engine", "torch", "--eval-fraction", "0"], "this run holds none out"),
        (["--eval-engine", "vllm"], "--eval-engine vllm needs vLLM, which is not installed"),
    ],
)
def test_bad_engine_options_are_one_line_and_write_nothing(
    sized, tmp_path, capsys, monkeypatch, args, says
):
    from spec_cli.engine import vllm

    monkeypatch.setattr(vllm, "available", lambda: False)  # (as on a machine without the extra)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(
        json.dumps({"conversations": [{"from": "gpt", "value": "only an answer"}]}) + "\n"
    )
    args = [str(empty) if a == "EMPTY" else a for a in args]
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--cache",
                str(sized["cache"]),
                "-v",
                str(sized["vm"]),
                "-o",
                str(out),
                "--max-steps",
                "2",
                *args,
            ]
        )
        == 1
    )
    err = " ".join(capsys.readouterr().err.split())
    assert says in err and err.count("error") <= 1, err
    assert not out.exists()


def test_best_keeper_takes_ties_at_the_later_step_and_never_a_worse_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")

    def snapshot(step: int) -> Path:
        folder = engine_process.step_dir(run, step) / "checkpoint"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights of %d" % step)
        (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
        return folder

    keeper = engine_process.BestKeeper(run)
    result = lambda step, al: {"step": step, "engine": "torch", "acceptance_length": al}  # noqa: E731
    assert keeper.consider(result(10, 1.5), snapshot(10))
    assert keeper.consider(result(20, 1.5), snapshot(20))  # a tie: the later step
    assert not keeper.consider(result(30, 1.4), snapshot(30))
    assert (run / "best" / "model.safetensors").read_bytes() == b"weights of 20"
    record = json.loads((run / "best" / "best.json").read_text())
    assert record["step"] == 20 and record["before"] == {
        "step": 10,
        "acceptance_length": 1.5,
        "comparable": True,
    }
    assert engine_process.BestKeeper(run).record["step"] == 20  # read back (--resume)
    # measured under other settings (another engine, say): not compared with; the next answer replaces it
    other = engine_process.BestKeeper(run, signature={"engine": "vllm"})
    assert not other.comparable and other.consider(result(40, 1.1), snapshot(40))
    assert json.loads((run / "best" / "best.json").read_text())["before"]["comparable"] is False
    # a run killed between the two renames of a replacement: RUN/.best.old is put back
    (run / "best").rename(run / ".best.old")
    engine.recover_best(run)
    assert (run / "best" / "best.json").is_file() and not (run / ".best.old").exists()


def test_busy_share_counts_each_moment_once():
    evaluator = engine_process.EngineEvaluator.__new__(engine_process.EngineEvaluator)
    evaluator.busy, evaluator.pending = [(0.0, 4.0), (2.0, 6.0)], {3: 9.0}
    assert evaluator.busy_share(0.0, 10.0) == pytest.approx(0.7)  # [0, 6] and [9, 10]
    assert evaluator.busy_share(6.0, 9.0) == 0.0


def _evaluator(tmp_path, command, warnings):
    config = engine_process.WorkerConfig(
        run_dir=str(tmp_path),
        engine="torch",
        target=str(tmp_path / "none"),
        prompts="mt-bench",
        depth=3,
        max_new_tokens=8,
        num_prompts=None,
        export_format="vllm",
    )
    evaluator = engine_process.EngineEvaluator(
        config, True, lambda record: None, warn=warnings.append
    )
    evaluator.command = command
    evaluator.start()
    return evaluator


def test_a_worker_that_dies_is_said_and_started_again_once(tmp_path):
    import sys
    import time

    warnings: list[str] = []
    evaluator = _evaluator(tmp_path, (sys.executable, "-c", "import sys; sys.exit(7)"), warnings)

    def died():
        deadline = time.time() + 30
        while evaluator.dead is None and time.time() < deadline:
            time.sleep(0.1)
        return evaluator.dead is not None

    try:
        assert died() and evaluator.poll() == []  # nothing was in flight: a line, not a record
        assert "the engine process ended (exit 7)" in warnings[-1]
        assert evaluator.ready() and evaluator.starts == 2  # started again, once ...
        assert "starting it again" in warnings[-1]
        assert died() and evaluator.poll() == []
        assert warnings[-1].endswith("no more engine evaluations in this run")
        assert not evaluator.ready() and evaluator.starts == 2  # ... and not a third time
    finally:
        evaluator.close()


def test_an_engine_that_does_not_answer_is_stopped_after_the_limit(tmp_path):
    import sys

    warnings: list[str] = []
    records: list[dict] = []
    evaluator = _evaluator(
        tmp_path, (sys.executable, "-c", "import time; time.sleep(300)"), warnings
    )
    evaluator.on_result = records.append
    process = evaluator.process
    evaluator.submit(5, tmp_path / "engine-eval" / "step-00000005" / "checkpoint")
    evaluator.finish(timeout=1)
    assert process.poll() is not None  # stopped, not left running
    assert "the engine took over 1 s for step(s) [5]: stopping it" in warnings[0]
    assert [(r["step"], "error" in r) for r in records] == [(5, True)] and not evaluator.pending
    evaluator.close()


def test_the_worker_ends_itself_when_the_trainer_is_gone(tmp_path):
    """The worker watches its parent: started with another pid as its trainer's (as after the trainer was
    killed and the worker re-parented), it exits within seconds, its stdin still open."""
    import os
    import subprocess
    import sys

    config = tmp_path / "worker.json"
    config.write_text(
        json.dumps(
            {
                "run_dir": str(tmp_path),
                "engine": "torch",
                "target": "x",
                "prompts": "mt-bench",
                "depth": 3,
                "max_new_tokens": 8,
                "num_prompts": None,
                "export_format": "vllm",
            }
        )
    )
    read, write = os.pipe()
    env = {**os.environ, engine_process.RESULT_FD: str(write), engine_process.PARENT_PID: "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "spec_cli.stages.engine_worker", str(config)],
        stdin=subprocess.PIPE,
        pass_fds=(write,),
        env=env,
    )
    os.close(write)
    try:
        assert process.wait(timeout=60) == 3
    finally:
        process.kill()
        os.close(read)


def test_a_new_run_removes_what_an_abandoned_run_left(sized, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    (run / "best" / "best.json").write_text("{}")
    (run / "best" / "model.safetensors").write_bytes(b"old")
    (run / "engine-eval" / "step-00000005").mkdir(parents=True)
    assert (
        main(
            [
                "train",
                "--cache",
                str(sized["cache"]),
                "-v",
                str(sized["vm"]),
                "-o",
                str(run),
                "--max-steps",
                "2",
                "--ttt-steps",
                "2",
            ]
        )
        == 0
    )
    assert "left by an earlier run in this folder that saved no checkpoint" in " ".join(
        capsys.readouterr().out.split()
    )
    assert not (run / "best").exists() and not (run / "engine-eval").exists()
    assert (
        ckpt.resolve_checkpoint(run).name == "step-00000002"
    )  # export and eval take the latest again


def test_inspect_shows_the_engines_curve_and_the_best(peaked_run, capsys):
    run = peaked_run["run"]
    best = json.loads((run / ckpt.BEST / ckpt.BEST_JSON).read_text())
    assert main(["inspect", str(run)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "engine (torch) acceptance length: " in printed and "@ 30" in printed
    assert (
        f"best: {run / 'best'} (step {best['step']}, acceptance length {best['acceptance_length']:.3f} in torch)"
        in printed
    )
