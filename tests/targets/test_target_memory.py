"""--target-memory: the share of the GPU a vLLM target engine may take, as vLLM is asked for it
(`gpu_memory_utilization`). spec train leaves the draft half the GPU unless told otherwise; precompute
leaves vLLM its own default. (The engine is stopped at its constructor: what matters is what it is
asked for; tests/targets/test_vllm_backend.py runs it.)"""

import pytest

from spec_cli.cli import main

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.engine


@pytest.fixture
def asked(monkeypatch):
    calls = []

    def llm(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("stopped here by the test")

    monkeypatch.setattr(vllm, "LLM", llm)
    return calls


def test_vllm_is_asked_for_the_share_the_user_gives_and_train_defaults_to_half(
    train_setup, tmp_path, asked, monkeypatch, capsys
):
    monkeypatch.setenv("SPEC_HOME", str(train_setup["root"] / "home"))
    s = {k: str(v) for k, v in train_setup.items()}
    train = [
        "train",
        "--target",
        s["target"],
        "--data",
        s["data"],
        "-v",
        s["vm"],
        "--target-engine",
        "vllm",
        "-q",
    ]
    assert main([*train, "-o", str(tmp_path / "a")]) == 1
    assert main([*train, "-o", str(tmp_path / "b"), "--target-memory", "0.3"]) == 1
    assert (
        main(
            [
                "precompute",
                "-t",
                s["target"],
                "-d",
                s["data"],
                "-v",
                s["vm"],
                "-o",
                str(tmp_path / "c"),
                "--target-engine",
                "vllm",
                "-q",
            ]
        )
        == 1
    )
    assert "stopped here by the test" in capsys.readouterr().err
    assert [call.get("gpu_memory_utilization") for call in asked] == [0.5, 0.3, None]
    assert main([*train, "-o", str(tmp_path / "d"), "--target-memory", "1.5"]) == 2  # out of (0, 1]
    assert "--target-memory" in capsys.readouterr().err
