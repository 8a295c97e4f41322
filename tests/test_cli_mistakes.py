"""Ordinary filesystem mistakes and Ctrl-C through the real CLI (issue 27, items 4 and 8): one line naming
the path and what to do, exit 1 (never "internal error"), nothing of the user's changed; Ctrl-C exits 130
with one line and keeps what was finished."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.cli import main
from tests import tiny
from tests.conftest import signalled_child, write_jsonl
from tests.draft.runs import vocab_and_cache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    """A vocab map, a small feature cache and a trained run of two checkpoints (one set for the module)."""
    root = tmp_path_factory.mktemp("cli_mistakes")
    data = write_jsonl(
        root / "chat.jsonl", [tiny.random_sharegpt(random.Random(i)) for i in range(16)]
    )
    vocab_and_cache(root, tiny_llama_dir, data)
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        assert main(train(root, root / "run", "--max-steps", "2", "--save-every", "1")) == 0
    finally:
        mp.undo()
    return {
        "root": root,
        "data": data,
        "vm": root / "vm.safetensors",
        "cache": root / "cache",
        "run": root / "run",
        "target": tiny_llama_dir,
    }


def train(root, out, *extra):
    return [
        "train",
        "-v",
        str(root / "vm.safetensors"),
        "--cache",
        str(root / "cache"),
        "-o",
        str(out),
        "--ttt-steps",
        "2",
        "--eval-fraction",
        "0",
        "-q",
        *extra,
    ]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "internal error" not in err, err
    return err


def test_output_that_is_an_existing_file_is_refused_and_kept(setup, tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    assert main(train(setup["root"], taken, "--max-steps", "1")) == 1
    assert one_line(capsys) == (
        f"error: -o {taken} is a file spec_cli did not write; a training run is a "
        "folder; pass -o a folder path that does not exist yet"
    )
    assert taken.read_text() == "mine"


def test_eval_output_that_is_a_file_is_refused(setup, tmp_path, capsys):
    taken = tmp_path / "report.json"
    taken.write_text("{}")
    assert (
        main(
            [
                "eval",
                "-t",
                str(setup["target"]),
                "--draft",
                str(setup["run"]),
                "--prompts",
                str(setup["data"]),
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "4",
                "-o",
                str(taken),
                "-q",
            ]
        )
        == 1
    )
    line = one_line(capsys)
    assert line.startswith(
        f"error: -o {taken} is a file spec_cli did not write; a spec eval folder is a folder"
    )
    assert taken.read_text() == "{}"


def test_output_below_a_file_is_refused(setup, tmp_path, capsys):
    parent = tmp_path / "a-file"
    parent.write_text("x")
    assert main(train(setup["root"], parent / "run", "--max-steps", "1")) == 1
    line = one_line(capsys)
    assert line.startswith("error: ") and str(parent) in line and "pass a folder path" in line


def test_a_folder_where_a_file_is_expected(setup, tmp_path, capsys):
    folder = tmp_path / "vm.safetensors"
    folder.mkdir()
    (folder / "keep").write_text("k")
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(setup["target"]),
                "-d",
                str(setup["data"]),
                "--draft-vocab-size",
                "64",
                "-o",
                str(folder),
                "-q",
            ]
        )
        == 1
    )
    assert str(folder) in one_line(capsys)
    assert (folder / "keep").read_text() == "k"


def test_an_unwritable_place_is_one_line(setup, capsys):
    # /sys refuses new entries even to root (chmod'd folders do not stop root, which CI runs as)
    if os.access("/sys", os.W_OK) and Path("/sys/spec-cli-probe").exists():
        pytest.skip("/sys is writable here")
    assert main(train(setup["root"], Path("/sys/spec-cli-run"), "--max-steps", "1")) == 1
    line = one_line(capsys)
    assert line.startswith("error: /sys/spec-cli-run ") and (
        "not writable" in line or "read-only" in line
    )


def test_a_checkpoint_missing_its_optimizer_state_is_named_and_not_resumed(setup, tmp_path, capsys):
    run = tmp_path / "run"
    import shutil

    shutil.copytree(setup["run"], run)
    latest = ckpt.latest_checkpoint(run)
    (latest / "optimizer.safetensors").unlink()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert (
        main(
            [
                "train",
                "--resume",
                "-o",
                str(run),
                "-v",
                str(setup["vm"]),
                "--max-steps",
                "3",
                "--reschedule",
                "-q",
            ]
        )
        == 1
    )
    assert one_line(capsys) == (
        f"error: the checkpoint {latest} lacks optimizer.safetensors, so training cannot "
        "resume from it; restore the file, or move that checkpoint folder out of "
        "checkpoints/ to resume from the one before it (export still reads it)"
    )
    assert {
        p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".spec.lock"
    } == {p: b for p, b in before.items() if p.name != ".spec.lock"}


def test_a_checkpoint_missing_its_weights_is_named(setup, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(setup["run"], run)
    latest = ckpt.latest_checkpoint(run)
    (latest / "model.safetensors").unlink()
    assert main(["export", str(run), "--format", "vllm", "-o", str(tmp_path / "out"), "-q"]) == 1
    line = one_line(capsys)
    assert str(latest) in line and "model.safetensors" in line
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- a checkpoint cut short


def flat(text: str) -> str:
    """Text without its whitespace: the console folds long lines (paths included) at its width."""
    return "".join(text.split())


def damaged_copy(setup, tmp_path, name: str, size: int):
    """A copy of the module's run whose newest checkpoint's `name` is cut to `size` bytes (as an interrupted
    copy leaves it): (run, its step-1, its step-2)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(setup["run"], run)
    first, second = ckpt.checkpoint_dirs(run)
    os.truncate(second / name, size)
    return run, first, second


def test_export_and_eval_name_a_cut_short_latest_checkpoint_and_the_intact_one_to_pass(
    setup, tmp_path, capsys
):
    run, first, second = damaged_copy(setup, tmp_path, "model.safetensors", 1000)
    header = 8 + int.from_bytes((first / "model.safetensors").read_bytes()[:8], "little")

    def refusal(given):
        return (
            f"error: the checkpoint {second} is damaged: model.safetensors is cut short (1,000 bytes; its header "
            f"alone takes {header:,}); pass the newest intact checkpoint of the run, {first}, instead of {given} "
            f"(`spec train --resume -o {run}` sets the damaged one aside and trains again from there)"
        )

    assert main(["export", str(run), "--format", "vllm", "-o", str(tmp_path / "out"), "-q"]) == 1
    assert one_line(capsys) == refusal(run)
    assert (
        main(
            [
                "eval",
                "-t",
                str(setup["target"]),
                "--draft",
                str(run),
                "--prompts",
                str(setup["data"]),
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "4",
                "-o",
                str(tmp_path / "eval"),
                "-q",
            ]
        )
        == 1
    )
    assert one_line(capsys) == refusal(run)
    assert main(["export", str(second), "--format", "vllm", "-o", str(tmp_path / "out"), "-q"]) == 1
    assert one_line(capsys) == refusal(second)
    assert not (tmp_path / "out").exists() and not (tmp_path / "eval").exists()
    # the checkpoint offered exports
    assert main(["export", str(first), "--format", "vllm", "-o", str(tmp_path / "out"), "-q"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_resume_sets_a_cut_short_latest_checkpoint_aside_and_continues_from_the_one_before(
    setup, tmp_path, capsys
):
    """The optimizer state of step 2 cut in its data: the resume says so in one warning, keeps the damaged
    folder (moved aside, bytes as they were) and trains step 2 again, to the weights the run first saved."""
    import torch
    from safetensors.torch import load_file

    run, first, second = damaged_copy(setup, tmp_path, "optimizer.safetensors", 100_000)
    full = (setup["run"] / "checkpoints" / second.name / "optimizer.safetensors").stat().st_size
    assert main(["train", "--resume", "-o", str(run), "-q"]) == 0
    err = capsys.readouterr().err
    assert flat(err) == flat(
        f"warning: {second} is damaged: optimizer.safetensors is cut short (100,000 of "
        f"{full:,} bytes); moved it aside to {second.name}.damaged (kept, not deleted); "
        f"resuming from {first}"
    )
    aside = second.with_name(second.name + ".damaged")
    assert (aside / "optimizer.safetensors").stat().st_size == 100_000 and (
        aside / "model.safetensors"
    ).is_file()
    assert [d.name for d in ckpt.checkpoint_dirs(run)] == [first.name, second.name]
    again = load_file(str(second / "model.safetensors"))
    before = load_file(str(setup["run"] / "checkpoints" / second.name / "model.safetensors"))
    assert again.keys() == before.keys() and all(torch.equal(again[k], before[k]) for k in before)
    # export reads the run again
    assert main(["export", str(run), "--format", "vllm", "-o", str(tmp_path / "out"), "-q"]) == 0


def test_resume_with_every_checkpoint_cut_short_is_refused_and_moves_nothing(
    setup, tmp_path, capsys
):
    run, first, second = damaged_copy(setup, tmp_path, "rng.safetensors", 10)
    os.truncate(first / "config.json", 10)
    assert main(["train", "--resume", "-o", str(run), "-q"]) == 1
    line = one_line(capsys)
    assert line.startswith(
        f"error: every checkpoint of {run} is damaged: {second.name}: rng.safetensors is cut short "
        f"(10 bytes; its header alone takes "
    ) and line.endswith("; restore the files from a copy, or start a new run folder (-o)"), line
    assert f"{first.name}: config.json does not parse (" in line
    assert [d.name for d in ckpt.checkpoint_dirs(run)] == [first.name, second.name]
    assert not list((run / "checkpoints").glob("*.damaged*"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, code, name", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")]
)
def test_a_stop_signal_in_training_exits_with_its_code_and_one_line_and_resumes(
    setup, tmp_path, sig, code, name
):
    """A real SIGINT (what Ctrl-C sends) or SIGTERM (what a scheduler sends) in the middle of `spec train`:
    the finished steps are saved and --resume goes on from them."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [
        sys.executable,
        "-m",
        "spec_cli.cli",
        *train(
            setup["root"], run, "--max-steps", "100000", "--save-every", "1000", "--log-every", "1"
        ),
    ]
    with signalled_child(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        deadline = time.monotonic() + 120
        while not (run / "log.jsonl").is_file() or not (run / "log.jsonl").read_text().strip():
            assert time.monotonic() < deadline and proc.poll() is None, (
                "spec train did not get going"
            )
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"stopped ({name}); finished work is kept")
    step = int(
        ckpt.latest_checkpoint(run).name.split("-")[1]
    )  # no --save-every step: the stop saved it
    assert step >= 1
    assert (
        main(
            [
                "train",
                "--resume",
                "-o",
                str(run),
                "-v",
                str(setup["vm"]),
                "--max-steps",
                str(step + 1),
                "--reschedule",
                "-q",
            ]
        )
        == 0
    )
    assert ckpt.latest_checkpoint(run).name == f"step-{step + 1:08d}"


def signals_during_steps(monkeypatch, at: dict[int, list[int]]) -> None:
    """Send this process the signals at[n] during its n-th optimizer update (in-process: deterministic)."""
    from spec_cli.trainer.trainer import Trainer

    real, done = Trainer.optimizer_step, [0]

    def optimizer_step(self):
        out = real(self)
        done[0] += 1
        for sig in at.get(done[0], []):
            os.kill(os.getpid(), sig)
        return out

    monkeypatch.setattr(Trainer, "optimizer_step", optimizer_step)


def test_sigterm_saves_the_step_all_stop_at_and_the_resumed_run_equals_the_straight_one(
    setup, tmp_path, monkeypatch, capsys
):
    """The signal during step 3's update is answered at step 4's host sync: step 4 is finished and saved
    (--save-every would save none), exit 143, and the resume ends bit for bit where a straight run ends."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    opts = ["--max-steps", "6", "--save-every", "100", "--lr", "3e-3"]
    assert main(train(setup["root"], straight, *opts)) == 0
    capsys.readouterr()
    with monkeypatch.context() as mp:
        signals_during_steps(mp, {3: [signal.SIGTERM]})
        assert main(train(setup["root"], run, *opts)) == 143
    assert capsys.readouterr().err.strip() == (
        "stopped (SIGTERM); finished work is kept: rerun the same command "
        "to continue (regenerate and precompute go on where they stopped, "
        "train with --resume)"
    )
    assert [d.name for d in ckpt.checkpoint_dirs(run)] == ["step-00000004"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are the caller's again
    assert main(train(setup["root"], run, *opts, "--resume")) == 0
    final = lambda folder: (ckpt.latest_checkpoint(folder) / "model.safetensors").read_bytes()  # noqa: E731
    assert ckpt.latest_checkpoint(run).name == "step-00000006" and final(run) == final(straight)


def test_a_save_that_cannot_finish_in_the_grace_period_leaves_the_last_checkpoint(
    setup, tmp_path, monkeypatch, capsys
):
    """A save measured at 0.6 s against --stop-grace 0.5: the step in flight is cut off or finished, but
    no new save starts; checkpoint 2 stands and the line says so."""
    from spec_cli.trainer import checkpoints

    run, real_save = tmp_path / "run", checkpoints.save

    def slow_save(trainer, step):
        time.sleep(0.6)
        return real_save(trainer, step)

    with monkeypatch.context() as mp:
        mp.setattr(checkpoints, "save", slow_save)
        signals_during_steps(mp, {3: [signal.SIGTERM]})
        args = train(
            setup["root"], run, "--max-steps", "6", "--save-every", "2", "--stop-grace", "0.5"
        )
        assert main([a for a in args if a != "-q"]) == 143
    said = " ".join("".join(capsys.readouterr()).split())  # (the console folds long lines)
    assert "the last checkpoint (step-00000002) stands; rerun with --resume" in said, said
    assert [d.name for d in ckpt.checkpoint_dirs(run)] == ["step-00000002"]


def test_save_every_minutes_saves_by_the_clock(setup, tmp_path):
    run = tmp_path / "run"
    assert (
        main(
            train(
                setup["root"],
                run,
                "--max-steps",
                "3",
                "--save-every",
                "100",
                "--keep-last",
                "5",
                "--save-every-minutes",
                "1e-6",
            )
        )
        == 0
    )
    assert [d.name for d in ckpt.checkpoint_dirs(run)] == [f"step-{k:08d}" for k in (1, 2, 3)]


def test_a_hand_edited_draft_config_is_refused_by_export_and_resume(setup, tmp_path, capsys):
    """The aux layers (same count, other layers) decide what the draft reads at serving time: an edit
    after training would export a draft that serves badly, so it is caught."""
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(setup["run"], run)
    config = ckpt.latest_checkpoint(run) / "config.json"
    edited = json.loads(config.read_text())
    edited["aux_layer_ids"] = [layer + 1 for layer in edited["aux_layer_ids"][:-1]] + edited[
        "aux_layer_ids"
    ][-1:]
    config.write_text(json.dumps(edited))
    expected = (
        f"error: {config} was changed after the checkpoint was saved (its content no longer matches the "
        "digest recorded in model.safetensors); restore the file as `spec train` wrote it; options such "
        "as the aux layers are part of what the draft learned and cannot be edited afterwards"
    )
    assert main(["export", str(run), "--format", "vllm", "-o", str(tmp_path / "out"), "-q"]) == 1
    assert one_line(capsys) == expected
    assert (
        main(
            [
                "train",
                "--resume",
                "-o",
                str(run),
                "-v",
                str(setup["vm"]),
                "--max-steps",
                "3",
                "--reschedule",
                "-q",
            ]
        )
        == 1
    )
    assert one_line(capsys) == expected
    # the same content re-spaced is not an edit
    config.write_text(
        json.dumps(
            json.loads(json.dumps(edited))
            | {
                "aux_layer_ids": json.loads(
                    (setup["run"] / "checkpoints" / config.parent.name / "config.json").read_text()
                )["aux_layer_ids"]
            },
            indent=4,
        )
    )
    assert main(["export", str(run), "--format", "vllm", "-o", str(tmp_path / "out"), "-q"]) == 0


# ----------------------------------------------------------------------------- resume says what it resumes


def test_resume_where_there_is_no_run_says_so(setup, tmp_path, capsys):
    empty = tmp_path / "nothing"
    assert main(["train", "--resume", "-o", str(empty), "-q"]) == 1
    assert one_line(capsys) == (
        f"error: --resume: there is no run to continue in {empty}: {empty} does not exist; "
        "pass the folder of the run to continue as -o, or drop --resume and give the "
        "inputs to start a run"
    )
    # a requeued job whose first attempt never started has every input: it starts, and says so
    assert main(train(setup["root"], empty, "--max-steps", "1", "--resume")) == 0
    assert (
        "holds no run" not in capsys.readouterr().err
    )  # (it did not exist: the warning names that)
    assert ckpt.latest_checkpoint(empty).name == "step-00000001"


@pytest.mark.parametrize("where", ["the cache", "inside the cache", "another cache", "a model"])
def test_output_that_is_an_input_or_another_kind_of_folder_is_refused_before_anything_is_written(
    setup, tmp_path, capsys, where
):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(setup["cache"], cache)
    args = [
        "train",
        "-v",
        str(setup["vm"]),
        "--cache",
        str(cache),
        "--ttt-steps",
        "2",
        "--eval-fraction",
        "0",
        "-q",
        "--max-steps",
        "1",
    ]
    out, expected = {
        "the cache": (
            cache,
            f"-o {cache} is this command's input --cache {cache}; nothing was written",
        ),
        "inside the cache": (
            cache / "run",
            f"-o {cache / 'run'} is inside this command's input --cache {cache}; "
            "nothing was written",
        ),
        "another cache": (
            setup["cache"],
            f"-o {setup['cache']} is a feature cache, not a training run; it is never replaced",
        ),
        "a model": (
            setup["target"],
            f"-o {setup['target']} is a model (or an exported draft), not a training run; "
            "it is never replaced",
        ),
    }[where]
    before = {p: p.read_bytes() for p in Path(out).rglob("*") if p.is_file()}
    assert main([*args, "-o", str(out)]) == 1
    assert one_line(capsys).startswith(f"error: {expected}; pass ")
    assert {p: p.read_bytes() for p in Path(out).rglob("*") if p.is_file()} == before


def test_resume_with_another_length_is_refused_by_name_unless_rescheduled(setup, tmp_path, capsys):
    run = tmp_path / "run"
    shutil_copy_run(setup["run"], run)  # --max-steps 2, checkpoints 1 and 2
    assert main(["train", "--resume", "-o", str(run), "--max-steps", "4", "-q"]) == 1
    assert one_line(capsys) == (
        "error: --resume with --max-steps 4: the run's schedule was laid over --max-steps 2 "
        "and its learning rate would jump; drop --max-steps to finish the run's schedule, "
        "or add --reschedule to lay it anew over --max-steps 4"
    )
    assert ckpt.latest_checkpoint(run).name == "step-00000002"
    assert (
        main(["train", "--resume", "-o", str(run), "--max-steps", "4", "--reschedule", "-q"]) == 0
    )
    assert ckpt.latest_checkpoint(run).name == "step-00000004"


def shutil_copy_run(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".spec.lock"))


def test_after_a_resume_the_log_holds_each_step_once(setup, tmp_path):
    """A run killed after logging steps its last checkpoint does not hold: the resume logs them again,
    and the log keeps the resumed run's records only."""
    import json

    run = tmp_path / "run"
    opts = ["--max-steps", "4", "--save-every", "2", "--log-every", "1", "--keep-last", "5"]
    assert main(train(setup["root"], run, *opts)) == 0
    import shutil

    shutil.rmtree(
        ckpt.latest_checkpoint(run)
    )  # as if killed after logging step 4, before saving it
    with open(run / "log.jsonl", "a") as f:
        f.write('{"split": "train", "step": 4, "lo')  # and in the middle of a line
    assert main(train(setup["root"], run, *opts, "--resume")) == 0
    steps = [
        json.loads(line)["step"]
        for line in (run / "log.jsonl").read_text().splitlines()
        if json.loads(line).get("split") == "train"
    ]
    assert steps == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB file system of its own (tmpfs: mounting needs root; skipped elsewhere, where the injected
    ENOSPC tests below still run), filled to the last page: the real ENOSPC a full disk gives."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with open(disk / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def full_disk_line(capsys) -> str:
    line = one_line(capsys)
    assert (
        line.startswith("error: no space left on the device holding ")
        or line.startswith("error: ")
        and " free, and " in line
        or "needs about" in line
    ), line
    return line


@pytest.mark.parametrize("command", ["build-vocab-map", "precompute", "train", "export"])
def test_a_full_disk_is_one_line_naming_the_folder_and_nothing_half_written_stays(
    setup, small_disk, capsys, command
):
    out = small_disk / "out"
    args = {
        "build-vocab-map": [
            "build-vocab-map",
            "-t",
            str(setup["target"]),
            "-d",
            str(setup["data"]),
            "--draft-vocab-size",
            "64",
            "-o",
            str(small_disk / "vm.safetensors"),
        ],
        "precompute": [
            "precompute",
            "-t",
            str(setup["target"]),
            "-d",
            str(setup["data"]),
            "-v",
            str(setup["vm"]),
            "-o",
            str(out),
        ],
        "train": train(setup["root"], out, "--max-steps", "1"),
        "export": ["export", str(setup["run"]), "--format", "vllm", "-o", str(out)],
    }[command]
    assert main([*args, "-q"]) == 1
    line = full_disk_line(capsys)
    assert str(small_disk) in line and "internal error" not in line
    left = sorted(
        p.name
        for p in small_disk.rglob("*")
        if p.name != "filler" and p.is_file() and p.name != ".spec.lock"
    )
    assert not [name for name in left if name.endswith(".tmp") or ".tmp" in name], left
    if command in ("build-vocab-map", "export"):
        assert not left, left


@pytest.mark.parametrize("where", ["checkpoint", "shard"])
def test_a_disk_that_fills_mid_write_is_one_line_and_the_last_good_artifact_stays(
    setup, tmp_path, capsys, monkeypatch, where
):
    """The writes a small file system cannot reach in a test: a checkpoint (safetensors' own error) and a
    cache shard (OSError without a file name), each failing as a full disk fails them."""
    from safetensors import SafetensorError

    from spec_cli.artifacts import checkpoint

    if where == "checkpoint":

        def full(*args, **kwargs):
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr(checkpoint, "save_file", full)
        run = tmp_path / "run"
        assert main(train(setup["root"], run, "--max-steps", "2")) == 1
        line = full_disk_line(capsys)
        assert f"holding {run / 'checkpoints'} while writing step-00000002/" in line
        assert ckpt.checkpoint_dirs(run) == [] and not list((run / "checkpoints").glob(".*"))
    else:
        real = Path.write_bytes

        def full(self, data):
            if self.name.startswith(".shard-"):
                raise OSError(28, "No space left on device")
            return real(self, data)

        monkeypatch.setattr(Path, "write_bytes", full)
        out = tmp_path / "cache"
        assert (
            main(
                [
                    "precompute",
                    "-t",
                    str(setup["target"]),
                    "-d",
                    str(setup["data"]),
                    "-v",
                    str(setup["vm"]),
                    "-o",
                    str(out),
                    "-q",
                ]
            )
            == 1
        )
        line = full_disk_line(capsys)
        assert f"holding {out} while writing shard-00000.safetensors: it needs about " in line
        assert not list(out.glob("shard-*")) and not list(out.glob(".*tmp"))


def test_a_disk_that_fills_at_a_later_checkpoint_gives_the_command_that_continues_the_run(
    setup, tmp_path, capsys, monkeypatch
):
    """The second checkpoint finds the disk full: a plain rerun would be refused (the folder holds step 1), so
    the hint is the --resume command, and that command finishes the run."""
    from safetensors import SafetensorError

    from spec_cli.artifacts import checkpoint

    real, files = checkpoint.save_file, [0]

    def full_after_the_first_checkpoint(*args, **kwargs):
        files[0] += 1
        if files[0] > 3:  # model, optimizer and rng of step 1 are written
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )
        return real(*args, **kwargs)

    run = tmp_path / "run"
    with monkeypatch.context() as mp:
        mp.setattr(checkpoint, "save_file", full_after_the_first_checkpoint)
        assert main(train(setup["root"], run, "--max-steps", "2", "--save-every", "1")) == 1
    line = full_disk_line(capsys)
    assert line.startswith(
        f"error: no space left on the device holding {run / 'checkpoints'} while writing "
        "step-00000002/: "
    )
    assert line.endswith(
        f" is free; free space there, then continue from step-00000001 with `spec train --resume "
        f"-o {run}` (or move the run folder to a disk with room and pass that as -o); nothing "
        "half-written was kept"
    ), line
    assert (
        main(train(setup["root"], run, "--max-steps", "2", "--save-every", "1")) == 1
    )  # the plain rerun
    assert "pass --resume to continue that run" in one_line(capsys)
    assert main(["train", "--resume", "-o", str(run), "-q"]) == 0  # the hinted command
    assert [d.name for d in ckpt.checkpoint_dirs(run)] == ["step-00000001", "step-00000002"]


@pytest.mark.parametrize("command", ["build-vocab-map", "train"])
def test_an_output_that_is_a_device_or_pipe_is_never_replaced_and_never_advised_removed(
    setup, tmp_path, capsys, command
):
    """A named pipe stands for a device node (/dev/null, /dev/full): --force, which the refusal of an
    existing map suggests, must not turn it into a regular file, and a path under it is named for what it is."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for out in (pipe, pipe / "x"):
        if command == "build-vocab-map":
            args = [
                "build-vocab-map",
                "-t",
                str(setup["target"]),
                "-d",
                str(setup["data"]),
                "--draft-vocab-size",
                "64",
                "-o",
                str(out),
                "--force",
                "-q",
            ]
        else:
            args = train(setup["root"], out, "--max-steps", "1")
        assert main(args) == 1
        line = one_line(capsys)
        assert "named pipe" in line and "remove" not in line, line
        assert pipe.is_fifo()


def test_a_stop_a_library_turned_into_its_own_error_is_still_a_stop(
    setup, tmp_path, monkeypatch, capsys
):
    """transformers' loader (and pyarrow's readers) turn a KeyboardInterrupt raised in their callbacks into
    errors of their own ("initialization failed"): SIGTERM there is still a stop (143, the stopped line),
    not "cannot load the target model" with exit 1."""
    from spec_cli import stopping
    from spec_cli.trainer import run as trainer_run

    def loading(path):
        try:
            raise stopping.Stopped(signal.SIGTERM)
        except KeyboardInterrupt as exc:
            raise RuntimeError("initialization failed") from exc

    monkeypatch.setattr(trainer_run, "load_vocab_map", loading)
    assert main(train(setup["root"], tmp_path / "run", "--max-steps", "1")) == 143
    assert capsys.readouterr().err.startswith("stopped (SIGTERM); finished work is kept")
