"""The real SmolLM2-135M target in vLLM: a draft trained a few steps on ShareGPT, exported, loaded by
vLLM; the export's engine check passes (vLLM's acceptance equals the PyTorch decoder's on the same
draft and prompts, and it proposes the same draft tokens), and an export whose aux ids are off by one
(the engines' convention mix-up, vLLM PR 50170) is caught by it. `spec eval --engine vllm` against `--engine torch` is compared on the tiny
models in tests/engine/test_vllm.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from spec_cli.cli import main

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.real,
    pytest.mark.slow,
]  # trains and serves SmolLM2 (minutes)


@pytest.fixture(scope="module")
def smol(tmp_path_factory, real_assets):
    root = tmp_path_factory.mktemp("smol")
    target = real_assets["target"]  # read only; this module writes into its own SPEC_HOME
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        lines = real_assets["sharegpt"].read_text(encoding="utf-8").split("\n")
        data = root / "sharegpt.jsonl"
        data.write_text("\n".join(lines[:200]) + "\n", encoding="utf-8")
        assert (
            main(
                [
                    "build-vocab-map",
                    "-t",
                    str(target),
                    "-d",
                    str(data),
                    "--draft-vocab-size",
                    "2048",
                    "-o",
                    str(root / "vm.safetensors"),
                    "-q",
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "train",
                    "--target",
                    str(target),
                    "--data",
                    str(data),
                    "-v",
                    str(root / "vm.safetensors"),
                    "-o",
                    str(root / "run"),
                    "--max-samples",
                    "32",
                    "--max-length",
                    "256",
                    "--pack",
                    "--batch-tokens",
                    "1024",
                    "--ttt-steps",
                    "2",
                    "--max-steps",
                    "6",
                    "--lr",
                    "2e-3",
                    "--eval-fraction",
                    "0",
                    "-q",
                ]
            )
            == 0
        )
    finally:
        mp.undo()
    return {
        "root": root,
        "run": root / "run",
        "data": data,
        "target": target,
    }


def test_smollm2_export_loads_in_vllm_with_the_checkpoints_acceptance_and_aux_ids_off_by_one_are_caught(
    smol, tmp_path
):
    """The export and a copy with its aux ids one layer early, checked against one reference decode of
    the checkpoint (the CLI's `--engine-check vllm` runs the same check: tests/engine/test_vllm.py)."""
    from spec_cli.errors import ExportCheckError
    from spec_cli.eval.engine_check import engine_check, reference_decode
    from spec_cli.export.source import load_source

    out = tmp_path / "export"
    args = ["export", str(smol["run"]), "--format", "vllm", "--engine-check", "none"]
    assert main([*args, "-t", str(smol["target"]), "-o", str(out), "-q"]) == 0
    src = load_source(smol["run"])
    reference = reference_decode(src, torch.bfloat16, smol["target"], depth=3)
    report = engine_check(out, "vllm", src, torch.bfloat16, smol["target"], 3, reference=reference)
    assert report.drafts_compared > 10 and report.drafts_equal >= 0.9
    assert report.shared == ["model.embed_tokens.weight"]  # SmolLM2 ties its head to the embedding

    # the same export with its aux ids one layer early: the engine check catches it
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    config = json.loads((bad / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [
        i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]
    ]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportCheckError, match="draft tokens at only"):
        engine_check(bad, "vllm", src, torch.bfloat16, smol["target"], 3, reference=reference)
