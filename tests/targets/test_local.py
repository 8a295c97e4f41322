"""--target-engine: checked before anything loads; without vLLM it is the one-line install hint."""

import pytest

import spec_cli.engine.vllm as vllm_engine
from spec_cli.cli import main

COMMANDS = {
    "precompute": [
        "precompute",
        "-t",
        "missing-target",
        "-d",
        "missing.jsonl",
        "-v",
        "missing.safetensors",
        "-o",
        "cache",
    ],
    "train": [
        "train",
        "-t",
        "missing-target",
        "-d",
        "missing.jsonl",
        "-v",
        "missing.safetensors",
        "-o",
        "run",
    ],
    "serve-target": ["serve-target", "-t", "missing-target", "--port", "0"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_without_vllm_the_option_says_how_to_install_it(command, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(vllm_engine, "available", lambda: False)
    assert main([*COMMANDS[command], "--target-engine", "vllm"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--target-engine vllm needs vLLM, which is not installed" in err
    assert "pip install -e '.[vllm]'" in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_unknown_engine_and_engine_without_a_live_target(capsys, tmp_path):
    assert (
        main(
            [
                "precompute",
                "-t",
                "x",
                "-d",
                "x",
                "-v",
                "x",
                "-o",
                str(tmp_path / "c"),
                "--target-engine",
                "tensorrt",
            ]
        )
        == 1
    )
    assert "unknown --target-engine 'tensorrt'" in capsys.readouterr().err
    if not vllm_engine.available():
        return
    (tmp_path / "cache").mkdir()
    assert (
        main(
            [
                "train",
                "--cache",
                str(tmp_path / "cache"),
                "-v",
                "x",
                "-o",
                str(tmp_path / "r"),
                "--target-engine",
                "vllm",
            ]
        )
        == 1
    )
    assert "runs a live --target" in capsys.readouterr().err
