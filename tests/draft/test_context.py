"""Context parallelism (spec_cli/draft/context.py) proven under torchrun x2 (gloo): the objective with each
rank holding half of every row equals the whole-row objective in loss, per-step losses, metrics and
every gradient (tests/draft/context_cp.py runs both in each rank), for EAGLE-3 (rows, packed documents,
two layers with activation checkpointing, a sliding window, lk-alpha, lk-lambda; fused and math kernels),
EAGLE-1/2 and P-EAGLE (COD-sampled: the group keeps the elements one process keeps, also for rows padded
to the group's chunks). Here: the shard's layout, without processes."""

import json

import pytest
import torch

from spec_cli.draft.context import ContextShard
from tests.launch import torchrun


def test_zig_zag_layout_balances_causal_work():
    shards = [ContextShard(size=4, rank=r, length=32) for r in range(4)]
    assert [s.chunks() for s in shards] == [
        ((0, 4), (28, 32)),
        ((4, 8), (24, 28)),
        ((8, 12), (20, 24)),
        ((12, 16), (16, 20)),
    ]
    work = [
        sum(t + 1 for a, b in s.chunks() for t in range(a, b)) for s in shards
    ]  # causal keys per query
    assert len(set(work)) == 1
    x = torch.arange(32)[None]
    assert torch.equal(torch.cat([s.owned(x) for s in shards], 1).sort().values, x)
    assert torch.equal(shards[1].index("cpu"), torch.tensor([4, 5, 6, 7, 24, 25, 26, 27]))
    with pytest.raises(ValueError, match="do not split into 8 equal chunks"):
        ContextShard(size=4, rank=0, length=30)


@pytest.mark.slow
def test_context_parallel_objective_equals_the_whole_rows(tmp_path):
    torchrun([["-m", "tests.draft.context_cp", tmp_path / "out"]], tmp_path / "launch")
    results = json.loads((tmp_path / "out" / "context.json").read_text())
    assert len(results) == 20
    for case, d in results.items():
        tol = 1e-6 if case == "eagle" else 1e-12  # (EAGLE-1's feature loss is computed in fp32)
        assert d["loss"] < tol * max(1.0, d["loss_value"]) and d["step_loss"] < tol, (case, d)
        assert d["correct"] == 0 and d["total"] == 0 and d["supervised"] == 0, (case, d)
        assert d["grad_rel"] < 100 * tol, (case, d)
    # the keys' traffic: per layer one all-gather of the keys and one of the values for the whole unroll
    # (the TTT steps reuse them; activation checkpointing gathers again once, in its recompute), one
    # reduce-scatter of each's gradients; not per TTT step (P-EAGLE's depths likewise reuse the depth-0
    # keys, and its plan gathers the rows' masks once)
    for case, d in results.items():
        forwards = 2 if d["checkpoint"] else 1
        assert d["all_gather_into_tensor"] == 2 * d["layers"] * forwards + d.get(
            "mask_gathers", 0
        ), (case, d)
        assert d["reduce_scatter_tensor"] == 2 * d["layers"], (case, d)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_kept_keys_are_freed_after_each_step(checkpoint):
    """The whole rows' keys kept for a TTT unroll are freed with it: a draft of two layers once kept every
    step's (the attention's saved bias held them, their history held the attention: a cycle)."""
    import gc

    from spec_cli.draft.context import ContextBias, LocalShard
    from spec_cli.draft.eagle3.ttt import ttt_forward
    from tests.draft import random_batch, tiny_draft

    draft = tiny_draft(num_hidden_layers=2)
    batch = random_batch(draft.config, [24, 17], 24, None)
    shard = LocalShard(size=2, rank=0, length=24)
    for _ in range(3):
        ttt_forward(draft, batch, shard=shard, ttt_steps=3, checkpoint=checkpoint).loss.backward()
    gc.collect()
    assert sum(isinstance(o, ContextBias) and o.gathered for o in gc.get_objects()) == 0
