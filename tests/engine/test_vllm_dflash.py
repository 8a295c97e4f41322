"""vLLM's DFlash drafter serving a DFlash export (`spec export --engine-check vllm`): vLLM 0.32's CPU build
loads the folder (DFlashDraftModel, its non-causal CPU attention), and its one-forward-per-block drafter
proposes the same tokens, step by step, as spec_cli's PyTorch decoder running the checkpoint
(tests/draft/dflash: that decoder against an explicit reference of vLLM's model)."""

from __future__ import annotations

import json
import random
import re

import pytest

from spec_cli.cli import main
from tests import tiny
from tests.engine.test_vllm import save_vllm_sized_target

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_dflash_proposes_what_spec_cli_proposes(tmp_path, monkeypatch, capsys, fmt):
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    target = tiny.peaked_copy(save_vllm_sized_target(tmp_path / "raw"), tmp_path / "target")
    rng = random.Random(0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(tiny.random_sharegpt(rng)) + "\n" for _ in range(80)))
    vm = str(tmp_path / "vm.safetensors")
    assert main(["build-vocab-map", "-t", str(target), "-d", str(data), "--draft-vocab-size", "64", "-o", vm,
                 "-q"]) == 0
    assert main(["train", "--target", str(target), "--data", str(data), "-v", vm, "--algorithm", "dflash",
                 "-o", str(tmp_path / "run"), "--block-size", "4", "--max-steps", "120", "--lr", "1e-2",
                 "--batch-tokens", "512", "--eval-every", "0", "-q"]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--format", fmt, "--dtype", "fp32", "--engine-check", "vllm",
                 "-t", str(target), "-o", str(tmp_path / "export")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "engine check passed: vLLM" in text and '"method": "dflash"' in text
    served, reference = re.search(r"accepted per position (\[[\d, ]+\]) vs (\[[\d, ]+\])", text).groups()
    assert served == reference and json.loads(served)[0] > 0
    same = re.search(r"same draft tokens at (\d+)% of (\d+) steps", text)
    assert int(same.group(1)) >= 90 and int(same.group(2)) > 10
