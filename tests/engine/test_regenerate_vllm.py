"""`spec regenerate --engine vllm` (the `vllm` extra): the target run by vLLM answers like the transformers
engine at temperature 0, on the tiny target sized for vLLM's CPU kernels (head_dim 32)."""

from __future__ import annotations

import json
import random

import pytest

from spec_cli.cli import main
from tests.conftest import write_jsonl
from tests.engine.test_vllm import save_vllm_sized_target
from tests.stages.test_regenerate import add_end_tokens, multi_turn

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.slow]  # two regenerations, one in vLLM (over 10 s)


def test_vllm_answers_as_transformers_does_at_temperature_0(tmp_path, capsys):
    target = add_end_tokens(save_vllm_sized_target(tmp_path / "target"))
    rng = random.Random(11)
    data = write_jsonl(tmp_path / "chats.jsonl", [multi_turn(rng, rng.randint(1, 3), system=i % 4 == 0)
                                                  for i in range(32)])
    outputs = {}
    for engine in ("transformers", "vllm"):
        out = tmp_path / f"{engine}.jsonl"
        assert main(["regenerate", "-t", str(target), "-d", str(data), "-o", str(out), "--engine", engine,
                     "--max-new-tokens", "32", "--max-length", "256", "--dtype", "fp32", "-q"]) == 0
        outputs[engine] = [json.loads(line) for line in out.read_text().splitlines()]
    meta = json.loads((tmp_path / "vllm.jsonl.meta.json").read_text())
    assert meta["engine"]["name"] == "vllm" and meta["engine"]["version"]

    pairs = list(zip(outputs["transformers"], outputs["vllm"]))
    assert len(pairs) == 32 and all(a["source_index"] == b["source_index"] for a, b in pairs)
    same = sum(a == b for a, b in pairs) / len(pairs)  # whole conversations, every answer and mark
    answers = [(x, y) for a, b in pairs for x, y in zip(a["messages"], b["messages"]) if x["role"] == "assistant"]
    with capsys.disabled():
        print(f"\nvLLM vs transformers, greedy fp32: {same:.0%} of conversations identical, "
              f"{sum(x == y for x, y in answers)}/{len(answers)} answers at the same place equal")
    assert same >= 0.9
    assert sum(m["role"] == "assistant" for r in outputs["vllm"] for m in r["messages"]) > len(pairs)  # 2nd turns
