"""The vocab map against an independent computation with collections.Counter."""

from collections import Counter

import pytest
import torch

from spec_cli.artifacts.vocab_map import (
    build_vocab_map,
    count_tokens,
    load_vocab_map,
    save_vocab_map,
)
from spec_cli.errors import ArtifactError, ConfigError


def reference_selection(ids: list[int], mask: list[int], vocab: int, vd: int) -> list[int]:
    counter = Counter(i for i, m in zip(ids, mask) if m)
    ranked = sorted(counter, key=lambda i: (-counter[i], i))[:vd]
    pad = [i for i in range(vocab) if i not in set(ranked)][: vd - len(ranked)]
    return sorted(ranked + pad)


@pytest.mark.parametrize("seed", range(5))
def test_selection_offsets_mask_and_coverage(seed, tmp_path):
    gen = torch.Generator().manual_seed(seed)
    vocab, vd = 300, 64
    # Zipf-ish ids with many ties
    ids = (torch.rand(5000, generator=gen) ** 3 * vocab).long().clamp_max(vocab - 1)
    mask = (torch.rand(5000, generator=gen) < 0.7).to(torch.uint8)
    counts = count_tokens(ids, mask, vocab)
    vm = build_vocab_map(counts, vd, {"tokenizer_fingerprint": "t"})
    expected = reference_selection(ids.tolist(), mask.tolist(), vocab, vd)
    assert vm.selected_token_ids.tolist() == expected
    for draft_id, target_id in enumerate(expected):
        assert draft_id + int(vm.d2t[draft_id]) == target_id
    assert vm.t2d.dtype == torch.bool and vm.t2d.numel() == vocab
    assert set(torch.nonzero(vm.t2d).flatten().tolist()) == set(expected)
    counter = Counter(i for i, m in zip(ids.tolist(), mask.tolist()) if m)
    total = sum(counter.values())
    assert vm.metadata["coverage"] == pytest.approx(sum(counter[i] for i in expected) / total)
    for size, cov in vm.metadata["coverage_by_size"].items():
        top = sorted(counter.values(), reverse=True)[: int(size)]
        assert cov == pytest.approx(sum(top) / total)
    save_vocab_map(vm, tmp_path / "vm.safetensors")
    loaded = load_vocab_map(tmp_path / "vm.safetensors")
    assert torch.equal(loaded.selected_token_ids, vm.selected_token_ids)
    assert torch.equal(loaded.d2t, vm.d2t) and torch.equal(loaded.t2d, vm.t2d)
    assert loaded.metadata["num_tokens_counted"] == total


def test_padding_when_fewer_distinct_ids_than_vd():
    counts = torch.zeros(50, dtype=torch.int64)
    counts[[7, 3, 40]] = torch.tensor([5, 5, 9])
    vm = build_vocab_map(counts, 6, {})
    # 40 (9), then 3 and 7 (tie: lower first), then padding with the lowest unused ids 0, 1, 2
    assert vm.selected_token_ids.tolist() == [0, 1, 2, 3, 7, 40]
    assert vm.d2t.tolist() == [0, 0, 0, 0, 3, 35]
    assert vm.coverage == 1.0


def test_bad_sizes_and_empty_data_are_clear_errors():
    counts = torch.ones(10, dtype=torch.int64)
    with pytest.raises(ConfigError, match="larger than the target vocab"):
        build_vocab_map(counts, 11, {})
    with pytest.raises(ArtifactError, match="no supervised tokens"):
        build_vocab_map(torch.zeros(10, dtype=torch.int64), 5, {})


def test_tampered_file_is_rejected(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    vm = build_vocab_map(torch.arange(20), 8, {})
    path = tmp_path / "vm.safetensors"
    save_vocab_map(vm, path)
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors["d2t"] = torch.zeros_like(tensors["d2t"])  # the classic silent failure
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ArtifactError, match="d2t/t2d do not match"):
        load_vocab_map(path)
