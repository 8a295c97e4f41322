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
from tests.draft.runs import vocab_and_cache
from tests.conftest import default_sigint, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    """A vocab map, a small feature cache and a trained run of two checkpoints (one set for the module)."""
    root = tmp_path_factory.mktemp("cli_mistakes")
    data = write_jsonl(root / "chat.jsonl", [tiny.random_sharegpt(random.Random(i)) for i in range(16)])
    vocab_and_cache(root, tiny_llama_dir, data)
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        assert main(train(root, root / "run", "--max-steps", "2", "--save-every", "1")) == 0
    finally:
        mp.undo()
    return {"root": root, "data": data, "vm": root / "vm.safetensors", "cache": root / "cache",
            "run": root / "run", "target": tiny_llama_dir}


def train(root, out, *extra):
    return ["train", "-v", str(root / "vm.safetensors"), "--cache", str(root / "cache"), "-o", str(out),
            "--ttt-steps", "2", "--batch-tokens", "256", "--eval-fraction", "0", "-q", *extra]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "internal error" not in err, err
    return err


def test_output_that_is_an_existing_file_is_refused_and_kept(setup, tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    assert main(train(setup["root"], taken, "--max-steps", "1")) == 1
    assert one_line(capsys) == (f"error: {taken} is a file where a folder is expected (or one of its parents "
                                "is a file); pass a folder path")
    assert taken.read_text() == "mine"


def test_eval_output_that_is_a_file_is_refused(setup, tmp_path, capsys):
    taken = tmp_path / "report.json"
    taken.write_text("{}")
    assert main(["eval", "-t", str(setup["target"]), "--draft", str(setup["run"]), "--prompts", str(setup["data"]),
                 "--num-prompts", "1", "--max-new-tokens", "4", "-o", str(taken), "-q"]) == 1
    line = one_line(capsys)
    assert line.startswith(f"error: {taken} ") and "folder" in line
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
    assert main(["build-vocab-map", "-t", str(setup["target"]), "-d", str(setup["data"]),
                 "--draft-vocab-size", "64", "-o", str(folder), "-q"]) == 1
    assert str(folder) in one_line(capsys)
    assert (folder / "keep").read_text() == "k"


def test_an_unwritable_place_is_one_line(setup, capsys):
    # /sys refuses new entries even to root (chmod'd folders do not stop root, which CI runs as)
    if os.access("/sys", os.W_OK) and Path("/sys/spec-cli-probe").exists():
        pytest.skip("/sys is writable here")
    assert main(train(setup["root"], Path("/sys/spec-cli-run"), "--max-steps", "1")) == 1
    line = one_line(capsys)
    assert line.startswith("error: /sys/spec-cli-run ") and ("not writable" in line or "read-only" in line)


def test_a_checkpoint_missing_its_optimizer_state_is_named_and_not_resumed(setup, tmp_path, capsys):
    run = tmp_path / "run"
    import shutil

    shutil.copytree(setup["run"], run)
    latest = ckpt.latest_checkpoint(run)
    (latest / "optimizer.safetensors").unlink()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert main(["train", "--resume", "-o", str(run), "-v", str(setup["vm"]), "--max-steps", "3", "-q"]) == 1
    assert one_line(capsys) == (f"error: the checkpoint {latest} lacks optimizer.safetensors, so training cannot "
                                "resume from it; restore the file, or move that checkpoint folder out of "
                                "checkpoints/ to resume from the one before it (export still reads it)")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".spec.lock"} == \
        {p: b for p, b in before.items() if p.name != ".spec.lock"}


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


@pytest.mark.slow
def test_ctrl_c_in_training_exits_130_with_one_line_and_resumes(setup, tmp_path):
    """A real SIGINT (what Ctrl-C sends) in the middle of `spec train`: the last checkpoint is kept and
    --resume goes on from it."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "spec_cli.cli", *train(setup["root"], run, "--max-steps", "100000",
                                                         "--save-every", "1")]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    while ckpt.latest_checkpoint(run) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("stopped (Ctrl-C); finished work is kept")
    step = int(ckpt.latest_checkpoint(run).name.split("-")[1])
    assert main(["train", "--resume", "-o", str(run), "-v", str(setup["vm"]), "--max-steps", str(step + 1),
                 "-q"]) == 0
    assert ckpt.latest_checkpoint(run).name == f"step-{step + 1:08d}"


def test_a_hand_edited_draft_config_is_refused_by_export_and_resume(setup, tmp_path, capsys):
    """The aux layers (same count, other layers) decide what the draft reads at serving time: an edit
    after training would export a draft that serves badly, so it is caught."""
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(setup["run"], run)
    config = ckpt.latest_checkpoint(run) / "config.json"
    edited = json.loads(config.read_text())
    edited["aux_layer_ids"] = [layer + 1 for layer in edited["aux_layer_ids"][:-1]] + edited["aux_layer_ids"][-1:]
    config.write_text(json.dumps(edited))
    expected = (f"error: {config} was changed after the checkpoint was saved (its content no longer matches the "
                "digest recorded in model.safetensors); restore the file as `spec train` wrote it; options such "
                "as the aux layers are part of what the draft learned and cannot be edited afterwards")
    assert main(["export", str(run), "--format", "vllm", "-o", str(tmp_path / "out"), "-q"]) == 1
    assert one_line(capsys) == expected
    assert main(["train", "--resume", "-o", str(run), "-v", str(setup["vm"]), "--max-steps", "3", "-q"]) == 1
    assert one_line(capsys) == expected
    # the same content re-spaced is not an edit
    config.write_text(json.dumps(json.loads(json.dumps(edited)) | {"aux_layer_ids": json.loads(
        (setup["run"] / "checkpoints" / config.parent.name / "config.json").read_text())["aux_layer_ids"]}, indent=4))
    assert main(["export", str(run), "--format", "vllm", "-o", str(tmp_path / "out"), "-q"]) == 0
