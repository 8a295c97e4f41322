"""End to end on the real built-in assets: SmolLM2-135M-Instruct's tokenizer and ShareGPT records.

The installed assets are read by path (tests/conftest.py's real_assets: resolved once, read only);
everything the tests write goes to their own temporary SPEC_HOME.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from spec_cli.cli import main

pytestmark = pytest.mark.real


@pytest.fixture
def sharegpt_subset(real_assets, tmp_path) -> Path:
    lines = real_assets["sharegpt"].read_text(encoding="utf-8").split("\n")
    assert len(lines) > 17000  # the salvage kept the complete records of the cut-off file
    path = tmp_path / "sharegpt300.jsonl"
    path.write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    return path


def test_build_vocab_map_on_real_tokenizer_and_sharegpt(real_assets, sharegpt_subset, tmp_path):
    from spec_cli.artifacts.vocab_map import load_vocab_map

    out = tmp_path / "vm.safetensors"
    target = real_assets["target"]
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(target),
                "-d",
                str(sharegpt_subset),
                "--draft-vocab-size",
                "8192",
                "--num-proc",
                "2",
                "-o",
                str(out),
                "-q",
            ]
        )
        == 0
    )
    vm = load_vocab_map(out)
    assert vm.target_vocab_size == 49152 and vm.draft_vocab_size == 8192
    assert vm.metadata["coverage"] > 0.8
    assert vm.metadata["num_tokens_counted"] > 100_000
    cov = vm.metadata["coverage_by_size"]
    assert cov["1024"] < cov["8192"] < cov["32000"] <= 1.0


def test_real_loss_mask_decodes_to_assistant_text(real_assets, sharegpt_subset):
    from spec_cli.data import records
    from spec_cli.data.template import encode_record, special_token_strings
    from spec_cli.targets.loading import load_tokenizer

    tokenizer = load_tokenizer(real_assets["target"])
    specials = special_token_strings(tokenizer)
    checked = 0
    for line in sharegpt_subset.read_text(encoding="utf-8").split("\n")[:40]:
        record = json.loads(line)
        kind, messages = records.normalise(record)
        if kind != "chat":
            continue
        out = encode_record(tokenizer, record, 1 << 20, specials)
        if isinstance(out, str):
            continue
        ids, mask = out
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        runs = [tokenizer.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
        assert runs == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        checked += 1
    assert checked > 20


@pytest.mark.slow  # (21-30 s: the GGUF dequantised on load)
def test_gguf_file_as_target(real_assets):
    from spec_cli import assets
    from spec_cli.targets.loading import load_tokenizer, resolve_target, tokenizer_fingerprint
    from tests.conftest import USER_HOME

    gguf = assets.package_file(assets.SMOLLM2, install=False)
    folder = resolve_target(gguf)  # converted once, cached under (the test's own) SPEC_HOME/targets
    assert folder.is_relative_to(Path(os.environ["SPEC_HOME"])) and not folder.is_relative_to(
        USER_HOME
    )
    assert (folder / "config.json").is_file()
    assert resolve_target(gguf) == folder
    assert tokenizer_fingerprint(load_tokenizer(folder)) == tokenizer_fingerprint(
        load_tokenizer(real_assets["target"])
    )
