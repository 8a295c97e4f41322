"""vLLM's DFlash drafter serving a DFlash export (`spec export --engine-check vllm`): vLLM 0.32's CPU build
loads the folder (DFlashDraftModel, its non-causal CPU attention), and its one-forward-per-block drafter
proposes the same tokens, step by step, as spec_cli's PyTorch decoder running the checkpoint
(tests/draft/dflash: that decoder against an explicit reference of vLLM's model)."""

from __future__ import annotations

import pytest

from spec_cli.cli import main
from tests.engine.test_vllm import served_as_checked, train_on_sized_target

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory):
    """A DFlash draft (blocks of 4) on the peaked vLLM-sized target, trained once for both."""
    return train_on_sized_target(
        tmp_path_factory.mktemp("dflash"),
        "--algorithm",
        "dflash",
        "--block-size",
        "4",
        "--max-steps",
        "120",
        "--eval-every",
        "0",
    )


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_dflash_proposes_what_spec_cli_proposes(
    dflash_run, tmp_path, monkeypatch, capsys, fmt
):
    run = dflash_run
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    capsys.readouterr()
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
                str(tmp_path / "export"),
            ]
        )
        == 0
    )
    text, _ = served_as_checked(capsys, 90)
    assert '"method": "dflash"' in text
