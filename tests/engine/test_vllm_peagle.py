"""vLLM's parallel drafting serving a P-EAGLE export (`spec export --engine-check vllm`): vLLM loads
mask_hidden and the mask token, and its one-forward drafter proposes the same tokens, step by step, as
spec_cli's PyTorch decoder running the checkpoint (tests/draft/peagle: the decoder against training)."""

from __future__ import annotations

import pytest

from spec_cli.cli import main
from tests.engine.test_vllm import served_as_checked, train_on_sized_target

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.parametrize("fmt", ["vllm"])
def test_vllm_parallel_drafting_proposes_what_spec_cli_proposes(tmp_path, monkeypatch, capsys, fmt):
    run = train_on_sized_target(tmp_path, "--algorithm", "peagle", "--ttt-steps", "4", "--max-steps", "120",
                                "--eval-every", "0")
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    capsys.readouterr()
    assert main(["export", str(run["run"]), "--format", fmt, "--dtype", "fp32", "--engine-check", "vllm",
                 "-t", str(run["target"]), "-o", str(tmp_path / "export")]) == 0
    text, served = served_as_checked(capsys, 90)
    assert '"parallel_drafting": true' in text and served[-1] > 0
