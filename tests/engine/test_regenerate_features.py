"""`spec regenerate --features` (the `vllm` extra): the feature cache written from the states vLLM
computed while answering equals `spec precompute` of the regenerated text run afresh (same identity,
every integer field equal, float fields within fp32 rounding), also after an interrupted run is resumed,
and precompute then finds it complete."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm")

from spec_cli.artifacts import feature_cache as fc  # noqa: E402
from spec_cli.cli import main  # noqa: E402
from spec_cli.stages import regenerate as stage  # noqa: E402
from tests.conftest import write_jsonl  # noqa: E402
from tests.stages.test_regenerate import add_end_tokens, multi_turn  # noqa: E402
from tests.tiny import save_vllm_sized_target  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # two vLLM engines (over 10 s)

# fp32 on a CPU: a state computed in a decode step or over a cached prefix against the same state in
# one prefill. Measured: aux and final hidden <= 2e-6, logsumexp <= 2e-5.
TOL = {"aux_hidden": 1e-5, "final_hidden": 5e-5, "lse": 2e-4}


def test_the_cache_kept_while_answering_is_the_precompute_of_the_answers(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    target = add_end_tokens(save_vllm_sized_target(tmp_path / "target"))
    rng = random.Random(5)
    data = write_jsonl(
        tmp_path / "chats.jsonl",
        [multi_turn(rng, rng.randint(1, 3), system=i % 4 == 0) for i in range(24)],
    )
    out, vocab, cache = tmp_path / "regen.jsonl", tmp_path / "vocab.safetensors", tmp_path / "cache"
    common = ["-t", str(target), "--max-length", "256", "--dtype", "fp32"]
    args = [
        "regenerate",
        *common,
        "-d",
        str(data),
        "-o",
        str(out),
        "--engine",
        "vllm",
        "--max-new-tokens",
        "32",
        "--chunk-size",
        "10",
        "--features",
        str(cache),
        "--vocab-map",
        str(vocab),
        "--draft-vocab-size",
        "64",
        "-q",
    ]
    write_part = stage._write_part

    def stopped_before_the_second_chunk(folder, k, part):
        if k == 1:
            raise KeyboardInterrupt
        write_part(folder, k, part)

    monkeypatch.setattr(stage, "_write_part", stopped_before_the_second_chunk)
    assert main(args) == 130  # Ctrl-C after the first of 3 chunks: its rows' states are kept
    assert (tmp_path / "regen.jsonl.parts" / "rows-00000.safetensors").is_file()
    monkeypatch.setattr(stage, "_write_part", write_part)
    assert main(args) == 0
    sidecar = json.loads((tmp_path / "regen.jsonl.meta.json").read_text())
    assert sidecar["parts_reused"] == 1
    meta = sidecar["features"]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(m["role"] == "assistant" for r in records for m in r["messages"]) > len(
        records
    )  # 2nd turns
    assert (
        meta["rows_computed"] == 0
        and meta["rows_replayed"] == fc.read_manifest(cache)["num_samples"]
    )
    assert (
        0.15 < meta["from_generation"] < 1
    )  # 30-40% here: random tokens, re-tokenised, often split otherwise
    assert not (tmp_path / "regen.jsonl.parts").exists()

    fresh = tmp_path / "fresh"
    assert (
        main(
            [
                "precompute",
                *common,
                "-d",
                str(out),
                "-v",
                str(vocab),
                "-o",
                str(fresh),
                "--target-engine",
                "vllm",
                "-q",
            ]
        )
        == 0
    )
    mine, theirs = fc.read_manifest(cache), fc.read_manifest(fresh)
    identity = (
        "target_fingerprint",
        "tokenizer_fingerprint",
        "vocab_map_fingerprint",
        "aux_layers",
        "dtype",
        "data_fingerprint",
        "max_length",
        "batch_tokens",
        "shard_tokens",
        "num_samples",
        "num_tokens",
    )
    assert {k: mine[k] for k in identity} == {k: theirs[k] for k in identity}
    diffs = {}
    for i in range(len(theirs["shards"])):
        a, b = load_file(str(cache / fc.shard_name(i))), load_file(str(fresh / fc.shard_name(i)))
        assert a.keys() == b.keys()
        for name in a:
            if a[name].is_floating_point():
                diffs[name] = max(diffs.get(name, 0.0), float((a[name] - b[name]).abs().max()))
            else:
                assert torch.equal(a[name], b[name]), name
    with capsys.disabled():
        print(
            "\nkept while answering vs precompute afresh:",
            " ".join(f"{k}={v:.1e}" for k, v in sorted(diffs.items())),
            f"; {meta['from_generation']:.0%} of the rows' positions computed while answering",
        )
    for name, diff in diffs.items():
        assert diff <= TOL[name], (name, diff)

    capsys.readouterr()
    assert main(["precompute", *common, "-d", str(out), "-v", str(vocab), "-o", str(cache)]) == 0
    assert "is already complete" in " ".join(capsys.readouterr().out.split())
