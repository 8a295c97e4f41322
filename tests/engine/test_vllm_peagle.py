"""vLLM's parallel drafting serving a P-EAGLE export: `spec export --engine-check vllm` (vLLM loads
mask_hidden and the mask token, and its one-forward drafter proposes the same tokens, step by step, as
spec_cli's PyTorch decoder running the checkpoint; tests/draft/peagle: the decoder against training), and
`spec tune` measuring the export as its serve command runs it (parallel_drafting, one engine per k)."""

from __future__ import annotations

import json

import pytest

from spec_cli.cli import main
from tests.engine.test_engine_loop import _QuietMeter
from tests.engine.test_vllm import served_as_checked, train_on_sized_target

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def peagle_run(tmp_path_factory):
    """A P-EAGLE draft of 4 depths trained on the peaked vLLM-sized target."""
    return train_on_sized_target(
        tmp_path_factory.mktemp("peagle"),
        "--algorithm",
        "peagle",
        "--ttt-steps",
        "4",
        "--max-steps",
        "120",
        "--eval-every",
        "0",
    )


@pytest.mark.parametrize("fmt", ["vllm"])
def test_vllm_parallel_drafting_proposes_what_spec_cli_proposes(
    peagle_run, tmp_path, monkeypatch, capsys, fmt
):
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    capsys.readouterr()
    assert (
        main(
            [
                "export",
                str(peagle_run["run"]),
                "--format",
                fmt,
                "--dtype",
                "fp32",
                "--engine-check",
                "vllm",
                "-t",
                str(peagle_run["target"]),
                "-o",
                str(tmp_path / "export"),
            ]
        )
        == 0
    )
    text, served = served_as_checked(capsys, 90)
    assert '"parallel_drafting": true' in text and served[-1] > 0


def test_tune_runs_a_peagle_export_as_its_serve_command_does(
    peagle_run, tmp_path, monkeypatch, capsys
):
    from spec_cli.stages import tune

    monkeypatch.setattr(tune.threads, "Meter", _QuietMeter)
    monkeypatch.setenv(
        "VLLM_CPU_KVCACHE_SPACE", "1"
    )  # GiB per engine (a whole number): one runs at a time
    export, out = tmp_path / "export", tmp_path / "tune"
    assert (
        main(
            [
                "export",
                str(peagle_run["run"]),
                "--format",
                "vllm",
                "--dtype",
                "fp32",
                "--engine-check",
                "none",
                "-t",
                str(peagle_run["target"]),
                "-o",
                str(export),
                "-q",
            ]
        )
        == 0
    )
    assert (
        '"parallel_drafting": true' in (export / "README.md").read_text()
    )  # the serve command tuned below
    assert (
        main(
            [
                "tune",
                str(export),
                "-t",
                str(peagle_run["target"]),
                "--max-k",
                "2",
                "--batch-sizes",
                "1,2",
                "--requests",
                "2",
                "--max-new-tokens",
                "12",
                "--repeats",
                "1",
                "--prompts",
                str(peagle_run["data"]),
                "-o",
                str(out),
            ]
        )
        == 0
    )
    printed = " ".join(capsys.readouterr().out.split())
    report = json.loads((out / "serving.json").read_text())
    assert report["settings"]["draft_engine"] == {
        "method": "eagle3",
        "parallel_drafting": True,
        "engine_per_k": True,
    }
    assert "a parallel drafter is tuned one engine per k, loaded in turn: 3 loads of" in printed
    table = report["table"]
    assert {(r["batch_size"], r["config"]) for r in table} == {
        (b, c) for b in (1, 2) for c in ("target", "k0", "k1", "k2")
    }
    assert all(
        r["same_as_target"] for r in table
    )  # every k, in its own engine, decodes the target's outputs
    config = report["speculative_config"]
    if config is None:
        assert "no configuration with drafts was faster" in report["why"]
    else:  # the schedule a parallel drafter serves: its num_speculative_tokens, or none
        assert config["parallel_drafting"] is True and config["model"] == str(export)
        assert {k for *_, k in config["num_speculative_tokens_per_batch_size"]} <= {
            0,
            config["num_speculative_tokens"],
        }
        assert (
            report["verified"]["all_same"] is True
            and '"parallel_drafting": true' in report["serve"]
        )
