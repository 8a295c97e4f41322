"""`spec train --stream`: the same weights as training without it (in process, remote, resumed after
Ctrl-C), and nothing left in the store or the stream folder afterwards."""

import json
import os
import random
import threading

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.cli import main
from spec_cli.errors import ConfigError
from spec_cli.stages import train as stage
from spec_cli.trainer import sources as train_sources
from tests import tiny
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    """Chat data, a vocab map, and the weights of a plain (not streamed) live run to compare with."""
    root = tmp_path_factory.mktemp("stream_train")
    data = write_jsonl(
        root / "chat.jsonl", [tiny.random_sharegpt(random.Random(5)) for _ in range(24)]
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        assert (
            main(
                [
                    "build-vocab-map",
                    "-t",
                    str(tiny_llama_dir),
                    "-d",
                    str(data),
                    "--draft-vocab-size",
                    "64",
                    "-o",
                    str(root / "vm.safetensors"),
                    "-q",
                ]
            )
            == 0
        )
        setup = {
            "root": root,
            "data": data,
            "vm": root / "vm.safetensors",
            "target": tiny_llama_dir,
        }
        plain = stage.run(config(setup, root / "plain"))
    finally:
        mp.undo()
    assert plain.steps == 4 and plain.stream is None
    assert not (root / "plain" / "stream.json").exists()
    return {**setup, "plain": weights(root / "plain")}


def config(setup, out, **kw) -> stage.TrainConfig:
    base = dict(
        vocab_map=setup["vm"],
        output=out,
        target=str(setup["target"]),
        data=str(setup["data"]),
        dtype="fp32",
        ttt_steps=2,
        lr=3e-3,
        max_steps=4,
        log_every=2,
        eval_every=2,
        save_every=2,
        eval_fraction=0.2,
        batch_tokens=256,
    )
    base.update(kw)
    return stage.TrainConfig.from_options(**base)


def weights(run_dir) -> dict:
    return load_file(str(ckpt.latest_checkpoint(run_dir) / "model.safetensors"))


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_streamed_training_equals_training_without_it(setup, tmp_path):
    result = stage.run(config(setup, tmp_path / "run", stream=True, prefetch=3))
    assert result.steps == 4
    assert_same(setup["plain"], weights(tmp_path / "run"))
    report = result.stream
    assert report["backend"] == "memory" and report["samples"] == 0 and report["bytes"] == 0
    assert report["consumed"] == 4 and report["produced"] >= 4 and 0 < report["peak_samples"] <= 4
    assert report["peak_bytes"] <= report["max_bytes"]
    assert report["max_bytes_source"].startswith(
        "auto: 4 batches of"
    )  # --prefetch 3 + 1, sized from the plan
    assert json.loads((tmp_path / "run" / "stream.json").read_text())["consumed"] == 4


def test_streamed_training_after_ctrl_c_resumes_to_the_same_weights(setup, tmp_path):
    """Ctrl-C mid-run: checkpoint saved, producers stopped, store and folder empty; `--resume
    --stream` through the CLI ends with the weights of the straight plain run."""
    folder = tmp_path / "shm"

    def interrupt(step):
        if step == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stage.run(
            config(setup, tmp_path / "run", stream=True, stream_dir=folder, prefetch=2),
            after_step=interrupt,
        )
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step-00000001"
    report = json.loads((tmp_path / "run" / "stream.json").read_text())
    assert report["backend"] == "folder" and report["samples"] == 0 and report["consumed"] == 1
    assert os.listdir(folder) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("spec-stream-")]

    args = [
        "train",
        "--target",
        str(setup["target"]),
        "--data",
        str(setup["data"]),
        "-v",
        str(setup["vm"]),
        "-o",
        str(tmp_path / "run"),
        "--dtype",
        "fp32",
        "--ttt-steps",
        "2",
        "--lr",
        "3e-3",
        "--max-steps",
        "4",
        "--log-every",
        "2",
        "--eval-every",
        "2",
        "--save-every",
        "2",
        "--eval-fraction",
        "0.2",
        "--batch-tokens",
        "256",
        "--stream",
        "--stream-dir",
        str(folder),
        "--stream-max-bytes",
        str(64 << 20),
        "--resume",
        "-q",
    ]
    assert main(args) == 0
    assert_same(setup["plain"], weights(tmp_path / "run"))
    report = json.loads((tmp_path / "run" / "stream.json").read_text())
    assert report["consumed"] == 3 and report["samples"] == 0 and report["max_bytes"] == 64 << 20
    assert report["max_bytes_source"] == "given: --stream-max-bytes"
    assert os.listdir(folder) == []


def test_remote_streamed_training_equals_training_without_it(setup, tmp_path):
    from tests.serve.harness import load_backend, start_server

    server = start_server(load_backend(setup["target"]), setup["target"])
    try:
        result = stage.run(
            config(setup, tmp_path / "run", target=None, remote=server.url, stream=True, prefetch=2)
        )
    finally:
        server.stop(grace=5)
        server.logic.backend.close()
    assert result.stream["workers"] == 2 and result.stream["samples"] == 0
    assert_same(setup["plain"], weights(tmp_path / "run"))


def test_stream_options_are_checked(setup, tmp_path, capsys, monkeypatch):
    with pytest.raises(ConfigError, match="feature cache"):
        train_sources.open_source(
            config(setup, tmp_path / "a", target=None, cache=tmp_path, stream=True), "cpu", None
        )
    with pytest.raises(ConfigError, match="--stream-dir"):
        train_sources.open_source(config(setup, tmp_path / "a", stream_dir=tmp_path), "cpu", None)
    loaded = []  # a bound smaller than one batch is refused before the target is loaded
    monkeypatch.setattr(train_sources.local, "open_backend", lambda *a, **kw: loaded.append(a))
    too_small = [
        "train",
        "--target",
        str(setup["target"]),
        "--data",
        str(setup["data"]),
        "-v",
        str(setup["vm"]),
        "-o",
        str(tmp_path / "b"),
        "--dtype",
        "fp32",
        "--max-steps",
        "2",
        "--batch-tokens",
        "256",
        "--stream",
        "--stream-dir",
        str(tmp_path / "sd"),
        "--stream-max-bytes",
        "1000",
        "-q",
    ]
    assert main(too_small) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "error: --stream-max-bytes 1000 bytes is smaller than one batch of this run (" in err
    assert (
        "raise --stream-max-bytes to at least 1M (or leave it out: auto), or lower --batch-tokens"
        in err
    )
    assert loaded == [] and not (tmp_path / "b").exists() and not (tmp_path / "sd").exists()
