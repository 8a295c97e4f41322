"""A draft trained with --draft-window served by vLLM 0.32's CPU build: the vLLM export (and the
speculators one) carries the window as vLLM reads it (layer_types + sliding_window), vLLM's draft
attends the same keys as spec_cli's windowed decoding (tests/draft/eagle3: that decoding against every
TTT step), so the engine proposes what spec_cli proposes. The window is 6 positions and the prompts run
to tens of tokens, so a window lost on the way changes the drafts."""

from __future__ import annotations

import json

import pytest

from spec_cli.cli import main
from tests.engine.test_vllm import served_as_checked, train_on_sized_target

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def windowed_run(tmp_path_factory):
    return train_on_sized_target(
        tmp_path_factory.mktemp("window"),
        "--draft-window",
        "6",
        "--ttt-steps",
        "2",
        "--max-steps",
        "120",
        "--eval-every",
        "0",
    )


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_serves_the_window_spec_cli_trained(windowed_run, tmp_path, monkeypatch, capsys, fmt):
    monkeypatch.setenv("SPEC_HOME", str(windowed_run["root"] / "home"))
    out = tmp_path / "export"
    assert (
        main(
            [
                "export",
                str(windowed_run["run"]),
                "--format",
                fmt,
                "--dtype",
                "fp32",
                "--engine-check",
                "vllm",
                "-t",
                str(windowed_run["target"]),
                "-o",
                str(out),
            ]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    assert layer["sliding_window"] == 6 and layer["layer_types"] == ["sliding_attention"]
    served_as_checked(capsys, 95)
