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
    data = write_jsonl(
        tmp_path / "chats.jsonl",
        [multi_turn(rng, rng.randint(1, 3), system=i % 4 == 0) for i in range(32)],
    )
    outputs = {}
    for engine in ("transformers", "vllm"):
        out = tmp_path / f"{engine}.jsonl"
        assert (
            main(
                [
                    "regenerate",
                    "-t",
                    str(target),
                    "-d",
                    str(data),
                    "-o",
                    str(out),
                    "--engine",
                    engine,
                    "--max-new-tokens",
                    "32",
                    "--max-length",
                    "256",
                    "--dtype",
                    "fp32",
                    "-q",
                ]
            )
            == 0
        )
        outputs[engine] = [json.loads(line) for line in out.read_text().splitlines()]
    meta = json.loads((tmp_path / "vllm.jsonl.meta.json").read_text())
    assert meta["engine"]["name"] == "vllm" and meta["engine"]["version"]

    pairs = list(zip(outputs["transformers"], outputs["vllm"]))
    assert len(pairs) == 32 and all(a["source_index"] == b["source_index"] for a, b in pairs)
    same = sum(a == b for a, b in pairs) / len(pairs)  # whole conversations, every answer and mark
    answers = [
        (x, y)
        for a, b in pairs
        for x, y in zip(a["messages"], b["messages"])
        if x["role"] == "assistant"
    ]
    with capsys.disabled():
        print(
            f"\nvLLM vs transformers, greedy fp32: {same:.0%} of conversations identical, "
            f"{sum(x == y for x, y in answers)}/{len(answers)} answers at the same place equal"
        )
    assert same >= 0.9
    assert sum(m["role"] == "assistant" for r in outputs["vllm"] for m in r["messages"]) > len(
        pairs
    )  # 2nd turns


def test_sampled_answers_in_vllm_are_the_same_however_the_requests_are_batched(tmp_path):
    """Temperature > 0 in vLLM: each answer samples from its own seeded generator. Prompts long enough that
    one engine step cannot take all of them (vLLM would split a prefill across steps, and then rewind the
    request's generator, which a CPU generator cannot do) still answer, the same file with 4 requests at a
    time as with all at once, and another --seed answers otherwise."""
    target = add_end_tokens(save_vllm_sized_target(tmp_path / "target"))
    rng = random.Random(4)
    data = write_jsonl(
        tmp_path / "long.jsonl",
        [{"messages": [{"role": "user", "content": tiny_text(rng, 120)}]} for _ in range(48)],
    )
    common = [
        "-t",
        str(target),
        "-d",
        str(data),
        "--engine",
        "vllm",
        "--temperature",
        "0.8",
        "--max-new-tokens",
        "24",
        "--max-length",
        "256",
        "--dtype",
        "fp32",
        "-q",
    ]
    files = {}
    for name, extra in {
        "all": ["--seed", "3"],
        "by4": ["--seed", "3", "--batch-size", "4"],
        "other": ["--seed", "4"],
    }.items():
        files[name] = tmp_path / f"{name}.jsonl"
        assert main(["regenerate", *common, "-o", str(files[name]), *extra]) == 0
    answers = {
        name: [
            json.loads(line)["messages"][-1]["content"] for line in path.read_text().splitlines()
        ]
        for name, path in files.items()
    }
    assert len(answers["all"]) == 48 and answers["all"] == answers["by4"]
    assert sum(a != b for a, b in zip(answers["all"], answers["other"])) > 24


def tiny_text(rng: random.Random, words: int) -> str:
    from tests import tiny

    return " ".join(rng.choice(tiny.WORDS) for _ in range(words))
