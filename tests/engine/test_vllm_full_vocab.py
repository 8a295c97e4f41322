"""A draft over the whole target vocabulary (`--draft-vocab-size` = the target's vocab size) in vLLM: vLLM
builds no draft_id_to_target_id then (llama_eagle3.py) and refuses a d2t key, so the vLLM and speculators
exports hold none; vLLM loads each, decodes with it as spec_cli's PyTorch decoder does (the export's
engine check), and `spec eval --engine vllm` runs on it."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from spec_cli.cli import main
from spec_cli.export.source import load_source
from tests.engine.test_vllm import served_as_checked, train_on_sized_target

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def full_vocab_run(tmp_path_factory):
    run = train_on_sized_target(
        tmp_path_factory.mktemp("full-vocab"),
        "--ttt-steps",
        "2",
        "--max-steps",
        "100",
        "--eval-every",
        "0",
        draft_vocab=400,
    )  # the sized target's whole vocab
    config = load_source(run["run"]).config
    assert config.draft_vocab_size == config.vocab_size == 400
    return run


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_serves_a_full_vocab_export_and_spec_eval_reads_it(
    full_vocab_run, tmp_path, monkeypatch, capsys, fmt
):
    run = full_vocab_run
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    capsys.readouterr()
    export = tmp_path / "export"
    assert (
        main(
            [
                "export",
                str(run["run"]),
                "--format",
                fmt,
                "--dtype",
                "fp32",
                "--engine-check",
                "vllm",
                "-t",
                str(run["target"]),
                "-o",
                str(export),
            ]
        )
        == 0
    )
    served_as_checked(capsys, 90)  # vLLM loaded it and accepted what the checkpoint accepts
    assert not {"d2t", "t2d"} & set(load_file(str(export / "model.safetensors")))
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "-t",
                str(run["target"]),
                "--draft",
                str(export),
                "--prompts",
                str(run["data"]),
                "--num-prompts",
                "3",
                "--max-new-tokens",
                "16",
                "--engine",
                "vllm",
                "-o",
                str(out),
                "-q",
            ]
        )
        == 0
    )
    report = json.loads((out / "eval.json").read_text())
    assert report["engine"]["load_problems"] == [] and report["draft"]["format"] == fmt
    assert sum(report["overall"]["accepted"]) > 0
    assert (
        report["overall"]["same_as_target"] == report["overall"]["turns"]
    )  # vLLM's output: the target's
