"""Reading every supported file shape, parallel determinism, and the tokenisation cache."""

import json
import random

import pytest
import torch

from spec_cli.data import records
from spec_cli.data.tokenize import tokenize_data
from spec_cli.errors import DataError
from spec_cli.targets.loading import load_tokenizer, tokenizer_fingerprint
from tests import tiny
from tests.conftest import write_jsonl


@pytest.fixture
def tokenizer(tiny_tokenizer_dirs):
    return load_tokenizer(tiny_tokenizer_dirs["chatml"])


def _run(path, tokenizer, **kw):
    return tokenize_data(path, tokenizer, tokenizer_fingerprint(tokenizer), **kw)


def test_all_file_shapes_give_the_same_tokens(tmp_path, tokenizer):
    import datasets

    rng = random.Random(3)
    sharegpt = [tiny.random_sharegpt(rng) for _ in range(12)]
    openai = [
        {
            "messages": [
                {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
                for t in r["conversations"]
            ]
        }
        for r in sharegpt
    ]
    ref = _run(write_jsonl(tmp_path / "a.jsonl", sharegpt), tokenizer)
    (tmp_path / "b.json").write_text(json.dumps(openai))
    datasets.Dataset.from_list(sharegpt).to_parquet(str(tmp_path / "c.parquet"))
    datasets.Dataset.from_list(openai).save_to_disk(str(tmp_path / "d_saved"))
    for path in ["b.json", "c.parquet", "d_saved"]:
        got = _run(tmp_path / path, tokenizer)
        assert torch.equal(got.input_ids, ref.input_ids), path
        assert torch.equal(got.loss_mask, ref.loss_mask), path
        assert torch.equal(got.offsets, ref.offsets), path


def test_skips_are_counted_by_reason(tmp_path, tokenizer):
    rng = random.Random(4)
    good = [tiny.random_sharegpt(rng) for _ in range(5)]
    bad = [
        {"conversations": []},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]},
        {"text": "   "},
        {
            "conversations": [
                {"from": "human", "value": " ".join(["water"] * 300)},
                {"from": "gpt", "value": "fine"},
            ]
        },
    ]
    data = _run(write_jsonl(tmp_path / "mixed.jsonl", good + bad), tokenizer, max_length=128)
    assert len(data) == 5
    assert data.metadata["skipped"] == {
        records.EMPTY: 2,
        records.NO_ASSISTANT: 1,
        records.MALFORMED: 1,
        records.TRUNCATED: 1,
    }
    assert data.source_index.tolist() == [0, 1, 2, 3, 4]


def test_zero_usable_records_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "bad.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}]
    )
    with pytest.raises(DataError, match="no usable records.*no assistant turn: 1"):
        _run(path, tokenizer)


def test_parallel_is_deterministic_and_second_run_uses_the_cache(tmp_path, tokenizer, monkeypatch):
    rng = random.Random(5)
    path = write_jsonl(tmp_path / "d.jsonl", [tiny.random_sharegpt(rng) for _ in range(700)])
    serial = _run(path, tokenizer, num_proc=1, use_cache=False)
    parallel = _run(path, tokenizer, num_proc=2)
    assert not parallel.metadata["cache_hit"]
    assert torch.equal(serial.input_ids, parallel.input_ids)
    assert torch.equal(serial.loss_mask, parallel.loss_mask)
    assert torch.equal(serial.offsets, parallel.offsets)

    import spec_cli.data.tokenize as tok_module

    def boom(*a, **k):
        raise AssertionError("the second run re-read the data")

    real_load_records = tok_module.load_records
    monkeypatch.setattr(tok_module, "load_records", boom)
    again = _run(path, tokenizer, num_proc=2)
    assert again.metadata["cache_hit"]
    assert torch.equal(again.input_ids, serial.input_ids)
    # a different max length is a different cache entry
    monkeypatch.setattr(tok_module, "load_records", real_load_records)
    assert not _run(path, tokenizer, max_length=64).metadata["cache_hit"]


def test_unreadable_data_is_a_clear_error(tmp_path, tokenizer):
    with pytest.raises(DataError, match="data not found"):
        _run(tmp_path / "nope.jsonl", tokenizer)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported data file"):
        _run(tmp_path / "x.csv", tokenizer)
    (tmp_path / "broken.jsonl").write_text('{"conversations": [\n')
    with pytest.raises(DataError, match="broken.jsonl: line 1 is not valid JSON"):
        _run(tmp_path / "broken.jsonl", tokenizer)
