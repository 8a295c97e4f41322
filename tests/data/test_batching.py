"""Batch plans and collation: every sample exactly once, the token budget kept, longest first, and
packed rows that keep each document whole and in order."""

import pytest
import torch

from spec_cli.artifacts.tokens import TokenizedData
from spec_cli.data.batching import (
    collate,
    collate_packed,
    padding_fraction,
    plan_batches,
    plan_packed,
)
from spec_cli.errors import ConfigError


def tokenized(lengths: list[int], seed: int = 0) -> TokenizedData:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    offsets = torch.cumsum(torch.tensor([0] + lengths), 0)
    return TokenizedData(
        torch.randint(1, 100, (total,), generator=gen).to(torch.int32),
        (torch.rand(total, generator=gen) < 0.5).to(torch.uint8),
        offsets,
        torch.arange(len(lengths)),
    )


LENGTHS = torch.tensor([5, 100, 7, 98, 50, 52, 6, 99, 7, 300, 1])


@pytest.mark.parametrize("budget,max_batch_size", [(200, None), (64, None), (512, 3), (1, None)])
def test_plans_keep_the_budget_and_take_samples_longest_first(budget, max_batch_size):
    plan = plan_batches(LENGTHS, batch_tokens=budget, max_batch_size=max_batch_size)
    order = sorted(
        range(len(LENGTHS)), key=lambda i: (-int(LENGTHS[i]), i)
    )  # longest first, ties by index
    assert [i for batch in plan for i in batch] == order
    for k, batch in enumerate(plan):
        padded = len(batch) * int(LENGTHS[batch].max())
        assert padded <= budget or len(batch) == 1  # only a sample alone may exceed the budget
        assert max_batch_size is None or len(batch) <= max_batch_size
        if k + 1 < len(plan):  # greedy: the next sample would not have fitted
            grown = batch + [plan[k + 1][0]]
            assert len(grown) * int(LENGTHS[grown].max()) > budget or (
                max_batch_size is not None and len(batch) == max_batch_size
            )


def test_batches_are_length_bucketed():
    lengths = torch.tensor([5, 100, 7, 98, 50, 52, 6, 99])
    plan = plan_batches(lengths, batch_tokens=200)
    assert sorted(i for b in plan for i in b) == list(range(8))
    for batch in plan:
        assert len(batch) * int(lengths[batch].max()) <= 200 or len(batch) == 1
    assert plan[0] == [1, 7]  # longest first, similar lengths together


def test_a_budget_below_one_token_is_an_option_error():
    with pytest.raises(ConfigError, match="--batch-tokens must be positive"):
        plan_batches(LENGTHS, batch_tokens=0)


def test_collate_right_pads_each_sample():
    data = tokenized([3, 6, 1])
    ids, am, lm = collate(data, [1, 0, 2], pad_id=7)
    assert ids.shape == am.shape == lm.shape == (3, 6)
    for row, i in enumerate([1, 0, 2]):
        sample_ids, sample_mask = data.sample(i)
        n = sample_ids.numel()
        assert torch.equal(ids[row, :n], sample_ids.long()) and (ids[row, n:] == 7).all()
        assert am[row].tolist() == [1] * n + [0] * (6 - n)
        assert torch.equal(lm[row, :n], sample_mask.long()) and not lm[row, n:].any()


def test_padding_fraction_from_known_counts():
    lengths = torch.tensor([4, 2, 3])
    assert padding_fraction(lengths, [[0, 1], [2]]) == pytest.approx(
        1 - 9 / 11
    )  # 4+4 and 3 padded slots
    assert padding_fraction(lengths, [[0], [1], [2]]) == 0.0
    assert padding_fraction(lengths, []) == 0.0


def test_packing_is_first_fit_decreasing_within_the_row_budget():
    # by hand, longest first: 12 alone (over the budget), 6 opens A (4 left), 5 opens B (5 left), 4 fills
    # A, then 3 and 2 fill B
    lengths = torch.tensor([6, 5, 4, 3, 2, 12])
    assert plan_packed(lengths, 10) == [[5], [0, 2], [1, 3, 4]]
    rows = plan_packed(LENGTHS, 128)
    assert sorted(i for row in rows for i in row) == list(range(len(LENGTHS)))
    for row in rows:
        assert int(LENGTHS[row].sum()) <= 128 or len(row) == 1


def test_packing_finds_the_rows_a_scan_of_every_row_finds():
    """The tree's first fit against the plain one (bench/pack_plan.py: scan the rows in order, take
    the first with room), on lengths with ties, zero-length and over-budget samples."""
    from bench.pack_plan import scanned

    g = torch.Generator().manual_seed(0)
    for n, budget in [(1, 8), (7, 8), (300, 64), (1000, 256), (513, 100)]:
        lengths = torch.randint(0, budget + budget // 2, (n,), generator=g)
        assert plan_packed(lengths, budget) == scanned(lengths.tolist(), budget), (n, budget)


def test_a_packed_row_keeps_each_document_whole_and_in_order():
    data = tokenized([3, 6, 1, 4])
    docs = [1, 3, 0]
    ids, am, lm, seq_lens = collate_packed(data, docs)
    assert seq_lens.tolist() == [[6, 4, 3]]
    assert ids.shape == am.shape == lm.shape == (1, 13) and am.all()
    start = 0
    for doc, n in zip(docs, seq_lens[0].tolist()):
        sample_ids, sample_mask = data.sample(doc)
        assert torch.equal(ids[0, start : start + n], sample_ids.long())
        assert torch.equal(lm[0, start : start + n], sample_mask.long())
        start += n
