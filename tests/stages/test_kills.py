"""SIGKILL never loses or corrupts work: train (--cache, --remote) and precompute, killed mid-run, then
killed again while resuming (once it writes something), then resumed, equal the straight run bit for
bit, leave the folder's lock free after each kill and resume without --no-resume. The logic is bench/kill_resume.py's
(its 20-random-kill version: `python bench/kill_resume.py`). Also, as the server and the straight run are
there anyway: `spec serve-target` + `spec train --remote` trains the weights of the in-process run."""

import importlib.util
import sys
from pathlib import Path

import pytest

from spec_cli.cli import main

_PATH = Path(__file__).resolve().parents[2] / "bench" / "kill_resume.py"
_spec = importlib.util.spec_from_file_location("kill_resume", _PATH)
kr = importlib.util.module_from_spec(_spec)
sys.modules["kill_resume"] = kr  # its dataclasses look their module up there
_spec.loader.exec_module(kr)

# The first kill comes at 0.4 of the straight run's duration (process start to exit; interpreter
# start-up included), early in the work; the resumed run is killed as soon as it writes a file of its
# own (a checkpoint, a shard, or one being written), which is in its work whatever the machine's speed.
MOMENT = 0.4


@pytest.fixture(scope="module")
def setup(train_setup):
    """bench/kill_resume.py's setup (a peaked tiny Llama, 48 chats, a vocab map, a cache: tests/conftest.py's
    train_setup is the same) and its `spec serve-target` subprocess."""
    setup = {**train_setup, "env": kr.env_for(train_setup["root"] / "home")}
    server = kr.Server(setup)
    yield {**setup, "url": server.url}
    server.close()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["train --cache", "train --remote", "precompute"])
def test_sigkill_then_resume_equals_the_straight_run(setup, tmp_path, which):
    scenario = {s.name: s for s in kr.scenarios(setup, setup["url"])}[which]
    straight = tmp_path / "straight"
    duration = kr.straight_run(scenario, straight)
    t = kr.kill_trial(
        scenario, straight, tmp_path / "killed", MOMENT * duration, then=(kr.new_files,)
    )
    assert t.killed and t.then_killed == [True], t  # both kills landed mid-command
    assert t.ok, (which, t.problems)
    assert t.lock_ok and t.resumed_ok and t.equal and t.reruns == 1

    if (
        which == "train --remote"
    ):  # the straight run against `spec serve-target` == training in process
        live = tmp_path / "live"
        assert (
            main(
                [
                    "train",
                    "--target",
                    str(setup["target"]),
                    "--data",
                    str(setup["data"]),
                    "-v",
                    str(setup["vm"]),
                    "--dtype",
                    "fp32",
                    "-o",
                    str(live),
                    *kr.TRAIN_OPTS,
                ]
            )
            == 0
        )
        assert kr.same_train(live, tmp_path / "straight") is None
        assert kr.TOKEN not in (tmp_path / "straight" / "run.json").read_text()
