"""P-EAGLE's training forward against an explicit reference, COD sampling's statistics, segments that add
up to the single forward (values and gradients), and one decoding forward that equals training's.

The reference flattens every element of a row (depth 0: all slots; depth d: the sampled anchors) into
one sequence and runs the draft's layers with plain SDPA under the mask the paper / speculators state:
an element sees the depth-0 elements of its document up to its anchor, and its own rollout up to its
depth. Nothing of the grid layout, the TTT attention kernel or the segment split is reused.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from spec_cli.draft.layers import KVCache, apply_rope
from spec_cli.draft.peagle import decoding
from spec_cli.draft.peagle.model import PEagleDraft
from spec_cli.draft.peagle.objective import PEagleObjective, sample_rollouts, valid_depths
from spec_cli.draft.unroll import packed_positions
from spec_cli.errors import ConfigError
from spec_cli.train_options import ObjectiveOptions
from tests.draft import (
    one_thread,  # noqa: F401 (autouse fixture)
    random_batch,
    selected_ids,
    tiny_config,
)


def peagle_draft(seed=0, **overrides) -> PEagleDraft:
    torch.manual_seed(seed)
    draft = PEagleDraft(tiny_config(algorithm="peagle", mask_token_id=5, **overrides))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        draft.embed_tokens.weight.normal_()
    draft.set_vocab_map(selected_ids())
    return draft


def packed_batch(config, seed=0):
    return random_batch(config, [20, 17], 20, seq_lens=[[9, 11], [6, 11]], seed=seed)


def documents(batch):
    B, T = batch.input_ids.shape
    doc = torch.full((B, T), -1)
    for b in range(B):
        docs = (
            batch.seq_lens[b].tolist()
            if batch.seq_lens is not None
            else [int(batch.attention_mask[b].sum())]
        )
        start = 0
        for i, n in enumerate(docs):
            doc[b, start : start + n] = i
            start += n
    return doc


def reference_states(draft, batch, rollouts):
    """Per row: states [E, H] of its elements in (depth, anchor) order, by flattening + an explicit mask."""
    cfg = draft.config
    B, T = batch.input_ids.shape
    pos = batch.position_ids if batch.position_ids is not None else torch.arange(T).expand(B, T)
    doc = documents(batch)
    out = []
    for b in range(B):
        anchors = [torch.arange(T)] + [a[r == b] for r, a in rollouts]
        depth = torch.cat([torch.full((len(a),), d) for d, a in enumerate(anchors)])
        anchor = torch.cat(anchors)
        ids = torch.where(depth == 0, batch.input_ids[b, anchor], cfg.mask_token_id)
        mask_state = draft.project(draft.mask_hidden.weight)[0, 0]
        hidden = torch.where(
            (depth == 0)[:, None], draft.project(batch.aux_hidden[b, anchor]), mask_state
        )
        position = pos[b, anchor] + depth
        da, dk = doc[b, anchor], doc[b, anchor]
        same_doc = (da[:, None] == dk[None]) & (da[:, None] >= 0) | (da[:, None] < 0) & (
            dk[None] < 0
        )
        allowed = same_doc & (
            ((depth[None] == 0) & (anchor[None] <= anchor[:, None]))
            | ((anchor[None] == anchor[:, None]) & (depth[None] <= depth[:, None]))
        )
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        ang = position[:, None].float() * inv
        cos, sin = torch.cat([ang, ang], -1).cos()[None], torch.cat([ang, ang], -1).sin()[None]
        embeds = draft.embed_tokens(ids)[None]
        h = hidden[None]
        for i, layer in enumerate(draft.decoder_layers):
            x = (
                torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(h)], -1)
                if i == 0
                else layer.input_layernorm(h)
            )
            a = layer.self_attn
            q = a.q_proj(x).view(1, -1, a.heads, a.head_dim).transpose(1, 2)
            k = a.k_proj(x).view(1, -1, a.kv_heads, a.head_dim).transpose(1, 2)
            v = a.v_proj(x).view(1, -1, a.kv_heads, a.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed[None, None], enable_gqa=True
            )
            h = h + a.out(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        out.append((depth, anchor, h[0]))
    return out


@pytest.mark.parametrize("layers,packed", [(1, False), (2, True)])
def test_parallel_forward_matches_the_explicit_mask(layers, packed):
    draft = peagle_draft(num_hidden_layers=layers)
    batch = (
        packed_batch(draft.config) if packed else random_batch(draft.config, [20, 13], 20, seed=1)
    )
    torch.manual_seed(3)
    rollouts = sample_rollouts(valid_depths(batch, 5), 0.7, 0.2)
    B, T = batch.input_ids.shape
    pos = batch.position_ids if batch.position_ids is not None else torch.arange(T).expand(B, T)
    from spec_cli.draft.attention import Segments

    bias = Segments.from_seq_lens(batch.seq_lens, T) if packed else None
    state0, deep = draft.parallel_forward(batch.input_ids, batch.aux_hidden, pos, bias, rollouts)
    for b, (depth, anchor, ref) in enumerate(reference_states(draft, batch, rollouts)):
        real = torch.arange(T) < int(batch.attention_mask[b].sum())  # padding slots: any value
        torch.testing.assert_close(state0[b][real], ref[depth == 0][real], atol=1e-5, rtol=1e-4)
        for d, (rows, anchors) in enumerate(rollouts, start=1):
            torch.testing.assert_close(
                deep[d - 1][rows == b], ref[depth == d], atol=1e-5, rtol=1e-4
            )


def test_cod_keeps_the_stated_share_nested_and_uniformly():
    T, K, r, floor = 400, 6, 0.7, 0.2
    valid = torch.ones(K, 1, T, dtype=torch.bool)
    for d in range(K):
        valid[d, 0, T - d :] = False  # the last d anchors have no target at depth d
    hits = torch.zeros(T)
    for seed in range(200):
        rollouts = sample_rollouts(valid, r, floor, generator=torch.Generator().manual_seed(seed))
        prev = set(range(T))
        for d, (rows, anchors) in enumerate(rollouts, start=1):
            assert len(anchors) == int((T - d) * max(r**d, floor))  # the share of the valid anchors
            kept = set(anchors.tolist())
            assert kept <= prev and all(a < T - d for a in kept)  # nested, and only valid anchors
            prev = kept
        hits[rollouts[0][1]] += 1
    share = hits[: T - 1] / 200  # depth 1: each valid anchor kept with probability ~ r
    assert abs(float(share.mean()) - int((T - 1) * r) / (T - 1)) < 1e-6
    assert float(share.std()) < 0.06  # uniform: binomial(200, 0.7) sd is 0.032


def test_evaluation_keeps_every_valid_element():
    draft = peagle_draft()
    batch = packed_batch(draft.config)
    objective = PEagleObjective(draft, ObjectiveOptions(ttt_steps=4)).eval()
    unit = objective.plan(batch)[0]
    valid = valid_depths(batch, 4)
    for d, (rows, anchors) in enumerate(unit.rollouts, start=1):
        nested = valid[1 : d + 1].all(0)
        assert torch.equal(
            torch.sort(rows * 100 + anchors).values,
            torch.sort(nested.nonzero()[:, 0] * 100 + nested.nonzero()[:, 1]).values,
        )


def test_the_loss_is_the_count_normalised_sum_over_supervised_elements():
    draft = peagle_draft()
    batch = packed_batch(draft.config)
    objective = PEagleObjective(draft, ObjectiveOptions(ttt_steps=4)).eval()
    unit = objective.plan(batch)[0]
    out = objective(batch, unit)
    T = batch.input_ids.shape[1]
    pos = packed_positions(batch.seq_lens, T)
    from spec_cli.draft.attention import Segments

    state0, deep = draft.parallel_forward(
        batch.input_ids,
        batch.aux_hidden,
        pos,
        Segments.from_seq_lens(batch.seq_lens, T),
        unit.rollouts,
    )
    valid = valid_depths(batch, 4)
    total, count = 0.0, 0
    for d in range(4):
        if d == 0:
            rows, anchors = valid[0].nonzero(as_tuple=True)
            states = state0[rows, anchors]
        else:
            (rows, anchors), states = unit.rollouts[d - 1], deep[d - 1]
        sup = batch.position_mask[rows, anchors + d].bool()
        logp = draft.logits(states[sup]).log_softmax(-1)
        total += float(-(batch.target_p[rows[sup], anchors[sup] + d] * logp).sum())
        count += int(sup.sum())
        assert int(out.supervised[d]) == int(sup.sum()) and int(out.total[d]) == rows.numel()
    assert math.isclose(float(out.loss), total / count, rel_tol=1e-5)


@pytest.mark.parametrize("segments", [2, 3])
def test_segments_add_up_to_the_single_forward_in_value_and_gradient(segments):
    draft = peagle_draft(num_hidden_layers=2)
    batch = packed_batch(draft.config, seed=4)
    options = ObjectiveOptions(ttt_steps=4, peagle_segments=segments)
    objective = PEagleObjective(draft, options)
    torch.manual_seed(11)
    units = objective.plan(batch)
    assert len(units) == segments
    outs = []
    for unit in units:
        out = objective(batch, unit)
        out.loss.backward()
        outs.append(out)
    parted = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad(set_to_none=True)
    from spec_cli.draft.peagle.objective import split_back

    single = objective(batch, split_back(units))  # the same COD elements, one forward
    single.loss.backward()
    merged = outs[0].merge(outs)
    torch.testing.assert_close(merged.loss, single.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged.step_loss, single.step_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(merged.correct, single.correct) and torch.equal(merged.total, single.total)
    assert set(parted) == {n for n, p in draft.named_parameters() if p.requires_grad}
    for name, p in draft.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(parted[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_one_decoding_forward_proposes_what_training_scores():
    """Serving's layout (verified slots, then depth - 1 mask slots, one causal forward) gives at every
    depth the state training computes for the rollout anchored at the newest verified slot."""
    draft = peagle_draft(num_hidden_layers=2)
    batch = random_batch(draft.config, [16], 16, seed=2)
    a, K = 9, 5  # the anchor: slots 0..a are verified
    valid = torch.zeros(K, 1, 16, dtype=torch.bool)
    valid[:, 0, a] = True
    rollouts = sample_rollouts(valid, 1.0, 1.0, sample=False)
    state0, deep = draft.parallel_forward(
        batch.input_ids, batch.aux_hidden, torch.arange(16)[None], None, rollouts
    )
    cache = KVCache(2)
    pending = decoding.catch_up(
        draft, cache, batch.input_ids[0, : a + 1], batch.aux_hidden[0, : a + 1]
    )
    with torch.no_grad():
        proposal = decoding.propose(draft, cache, pending, K, 1, 0, 0.0, None)
    expected = [draft.logits(state0[0, a]).argmax()] + [draft.logits(s[0]).argmax() for s in deep]
    assert proposal.tokens.tolist() == draft.to_target_ids(torch.stack(expected)).tolist()
    assert len(cache) == a + 1 + K - 1  # the mask slots are in the cache until the loop crops them
    with pytest.raises(ConfigError, match="chain"):
        decoding.propose(draft, KVCache(2), pending, K, 4, 8, 0.0, None)


def test_a_loss_that_does_not_add_over_elements_is_refused():
    with pytest.raises(ConfigError, match="per-element"):
        PEagleObjective(peagle_draft(), ObjectiveOptions(loss="lk-lambda"))


def test_checkpointing_with_the_chunked_head_gives_the_same_loss_and_gradients(monkeypatch):
    """With activation checkpointing each depth's soft-CE runs chunk by chunk of elements (several
    chunks here), recomputed in backward; loss, metrics and gradients stay the plain head's."""
    from spec_cli.draft import losses

    monkeypatch.setattr(
        losses, "HEAD_CHUNK_BYTES", 4 * 3 * tiny_config(algorithm="peagle").draft_vocab_size
    )
    draft = peagle_draft(num_hidden_layers=2)
    batch = packed_batch(draft.config, seed=2)
    params = [p for p in draft.parameters() if p.requires_grad]
    outs, grads = [], []
    for checkpointing in (False, True):
        objective = PEagleObjective(
            draft, ObjectiveOptions(ttt_steps=4), activation_checkpointing=checkpointing
        )
        torch.manual_seed(5)  # the same COD draw
        out = objective(batch)
        outs.append(out)
        grads.append(torch.autograd.grad(out.loss, params))
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(outs[1].step_loss, outs[0].step_loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(outs[1].correct, outs[0].correct) and torch.equal(
        outs[1].supervised, outs[0].supervised
    )
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
