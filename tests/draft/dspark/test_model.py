"""DSpark's training layout, its decoding and its loss against explicit references written from vLLM 0.32's
qwen3_dspark.py and DSparkSpeculator (the block [anchor, noise ...] at the anchor's positions, query i
proposing the token after it; logits_i = lm_head(h_i) + markov_w2(markov_w1[previous token]) sampled left
to right; the confidence head sigmoid(proj(cat[h_i, markov_w1[previous]])) in fp32) and the DSpark
paper's three-term loss. The backbone's reference is DFlash's (tests/draft/dflash/test_model.py)."""

import math

import pytest
import torch

from spec_cli.draft.dspark import decoding
from spec_cli.draft.dspark.model import DSparkDraft
from spec_cli.draft.dspark.objective import DSparkObjective, position_weights
from spec_cli.errors import ConfigError
from spec_cli.train_options import ObjectiveOptions
from tests.draft import (
    one_thread,  # noqa: F401 (autouse fixture)
    tiny_config,
)
from tests.draft.dflash.test_model import (
    _docs,
    batch_for,
    checkpointing_changes_nothing,
    randomised,
    reference_block,
)

RANK = 6


def dspark_draft(seed=0, size=3, layers=2, with_markov=True, confidence=True) -> DSparkDraft:
    torch.manual_seed(seed)
    config = tiny_config(
        algorithm="dspark",
        mask_token_id=5,
        aux_layer_ids=[1, 2, 3, 5, 6],
        num_hidden_layers=layers,
        extra={
            "block_size": size,
            "markov_rank": RANK,
            "confidence_head": confidence,
            "confidence_with_markov": with_markov,
        },
    )
    draft = randomised(DSparkDraft(config))
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.normal_()  # a bias large enough to change the argmax
    return draft


def options(**kw):
    return ObjectiveOptions(block_size=3, markov_rank=RANK, **kw)


def ref_logits(draft, h, previous):
    """vLLM: compute_draft_logits(h) + markov_bias(markov_embed(previous))."""
    return (
        h @ draft.lm_head.weight.T
        + draft.markov_head.markov_w1.weight[previous] @ draft.markov_head.markov_w2.weight.T
    )


def ref_confidence(draft, h, previous, with_markov=True):
    x = torch.cat([h, draft.markov_head.markov_w1.weight[previous]], -1) if with_markov else h
    p = draft.confidence_head.proj
    return torch.sigmoid(x.double() @ p.weight.double().T + p.bias.double())[..., 0].float()


def test_decoding_is_one_block_forward_then_the_markov_chain_vllm_samples():
    draft = dspark_draft(size=4)
    batch = batch_for(draft, False)
    aux, ids = batch.aux_hidden[0], batch.input_ids[0]
    with torch.no_grad():
        cache = draft.new_cache()
        state = decoding.catch_up(draft, cache, ids[:9], aux[:9])
        proposal = decoding.propose(draft, cache, state, 4, 1, 0, 0.0, None)
        assert len(cache) == 9  # the block's keys never enter the cache
        # the block: [newest, noise x 3] at positions 9 .. 12 (the anchor predicts position 10)
        h = reference_block(
            draft,
            aux[:9],
            torch.arange(9),
            torch.tensor([int(ids[8]), 5, 5, 5]),
            torch.arange(9, 13),
        )
        previous, want, conf = int(ids[8]), [], []
        for i in range(4):
            token = int(draft.to_target_ids(ref_logits(draft, h[i], previous).argmax()))
            conf.append(ref_confidence(draft, h[i], previous))
            want.append(token)
            previous = token
        assert proposal.tokens.tolist() == want and proposal.parents.tolist() == [-1, 0, 1, 2]
        torch.testing.assert_close(proposal.confidence, torch.stack(conf), rtol=1e-5, atol=1e-6)
        # the bias matters here: the block's own argmax differs from the chain somewhere
        plain = draft.to_target_ids((h @ draft.lm_head.weight.T).argmax(-1)).tolist()
        assert plain != want
        with pytest.raises(ConfigError, match="at most 4 per forward"):
            decoding.propose(draft, cache, state, 5, 1, 0, 0.0, None)
        with pytest.raises(ConfigError, match="not a tree"):
            decoding.propose(draft, cache, state, 3, 2, 0, 0.0, None)


def test_sampled_drafts_carry_the_biased_distribution_they_were_drawn_from():
    draft = dspark_draft(size=3)
    batch = batch_for(draft, False)
    with torch.no_grad():
        cache = draft.new_cache()
        state = decoding.catch_up(draft, cache, batch.input_ids[0, :7], batch.aux_hidden[0, :7])
        proposal = decoding.propose(
            draft, cache, state, 3, 1, 0, 0.7, torch.Generator().manual_seed(0)
        )
        h = reference_block(
            draft,
            batch.aux_hidden[0, :7],
            torch.arange(7),
            torch.tensor([int(batch.input_ids[0, 6]), 5, 5]),
            torch.arange(7, 10),
        )
        previous = int(batch.input_ids[0, 6])
        for i in range(3):
            q = torch.softmax(ref_logits(draft, h[i], previous) / 0.7, -1)
            full = torch.zeros(draft.config.vocab_size).index_copy_(
                0, draft.to_target_ids(torch.arange(len(q))), q
            )
            torch.testing.assert_close(proposal.q[i], full, rtol=1e-4, atol=1e-6)
            previous = int(proposal.tokens[i])


@pytest.mark.parametrize("packed", [False, True])
def test_the_loss_is_the_three_term_mix_over_supervised_elements(packed):
    draft = dspark_draft()
    batch = batch_for(draft, packed)
    doc, pos = _docs(batch)
    opts = options(block_decay=2.0, ce_weight=0.3, l1_weight=0.6, confidence_weight=0.5)
    out = DSparkObjective(draft, opts)(batch)
    B, T = batch.input_ids.shape
    num = den = 0.0
    for i in range(3):
        w = math.exp(-i / 2.0)
        hits = counted = 0
        losses = []
        for b in range(B):
            for t in range(T):
                s = t + i  # query i of slot t proposes x[t + 2 + i]: the shifted batch's row t + i
                if doc[b, t] < 0 or s >= T or doc[b, s] != doc[b, t] or not batch.loss_mask[b, s]:
                    continue
                counted += 1
                ctx = (doc[b] == doc[b, t]) & (torch.arange(T) <= t)
                block = torch.tensor([int(batch.input_ids[b, t]), 5, 5])
                h = reference_block(
                    draft,
                    batch.aux_hidden[b, ctx],
                    pos[b, ctx],
                    block,
                    pos[b, t] + 1 + torch.arange(3),
                )[i]
                previous = int(batch.input_ids[b, s])  # x[t + 1 + i], the true token before it
                logits = ref_logits(draft, h, previous)
                hits += int(draft.to_target_ids(logits.argmax()) == batch.target_ids[b, s])
                if batch.position_mask[b, s]:
                    p_full = (
                        batch.target_p[b, s] * batch.target_mass[b, s]
                    )  # the target's full-vocab probabilities
                    q = logits.softmax(-1)
                    l1 = (q - p_full).abs().sum() + (
                        1 - p_full.sum()
                    )  # its mass outside the draft vocab is missed
                    alpha = torch.minimum(q, p_full).sum()
                    ce = -logits.log_softmax(-1)[batch.target_p[b, s].argmax()]
                    c = ref_confidence(draft, h, previous)
                    bce = -(alpha * torch.log(c) + (1 - alpha) * torch.log(1 - c))
                    losses.append(0.3 * ce + 0.6 * l1 + 0.5 * bce)
        num += w * float(sum(losses).detach())
        den += w * len(losses)
        assert (
            int(out.total[i]) == counted
            and int(out.supervised[i]) == len(losses)
            and int(out.correct[i]) == hits
        )
        torch.testing.assert_close(
            out.step_loss[i], torch.stack(losses).mean().detach(), rtol=1e-4, atol=1e-5
        )
    torch.testing.assert_close(out.loss.detach(), torch.tensor(num / den), rtol=1e-4, atol=1e-5)
    out.loss.backward()
    grads = {n: p.grad for n, p in draft.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), [
        n for n, g in grads.items() if g is None or g.abs().sum() == 0
    ]
    assert draft.embed_tokens.weight.grad is None


def test_the_hits_are_what_decoding_each_slot_with_its_own_proposals_accepts():
    """On text that is the target's own (target_ids = the next data token), a slot's decoded chain is accepted
    up to its first miss; the objective's per-position hits, teacher-forced, are exactly those of the chain
    wherever the positions before matched. So the prefix of consecutive teacher-forced hits of each slot
    is the chain's accepted length, and the objective's hit counts are these per-(slot, position) hits."""
    draft = dspark_draft(seed=2, size=3)
    batch = batch_for(draft, False, seed=3)
    T = int(batch.attention_mask[0].sum())
    rng = torch.Generator().manual_seed(0)
    with (
        torch.no_grad()
    ):  # the data: the draft's own first proposal at 3 slots in 4 (its chains then hit)
        for s in range(T - 1):
            cache = draft.new_cache()
            state = decoding.catch_up(
                draft, cache, batch.input_ids[0, : s + 1], batch.aux_hidden[0, : s + 1]
            )
            first = int(decoding.propose(draft, cache, state, 1, 1, 0, 0.0, None).tokens[0])
            if torch.rand((), generator=rng) < 0.75:
                batch.input_ids[0, s + 1] = first
    batch.target_ids[0, : T - 1] = batch.input_ids[0, 1:T]
    batch.position_mask[0] = draft.t2d[
        batch.target_ids[0]
    ]  # supervised: the target's top-1 is a draft token
    batch.loss_mask[:] = 0
    batch.loss_mask[0, : T - 1] = 1
    out = DSparkObjective(draft, options())(batch)
    _, pos = _docs(batch)
    with torch.no_grad():
        states = draft.block_forward(
            batch.input_ids[:1], batch.aux_hidden[:1], pos[:1], None, 3, first=0
        )
        forced = torch.stack(
            [
                draft.to_target_ids(
                    draft.biased_logits(
                        states[i][0], draft.markov_embed(torch.roll(batch.input_ids[0], -i))
                    ).argmax(-1)
                )
                for i in range(3)
            ]
        )
    hit = torch.zeros(3, T, dtype=torch.bool)
    for i in range(3):
        hit[i, : T - 1 - i] = forced[i, : T - 1 - i] == batch.target_ids[0, i : T - 1]
    assert (
        out.correct.tolist() == hit.sum(1).tolist()
        and int(hit[0].sum()) > 3
        and int(hit[1].sum()) > 0
    )
    with torch.no_grad():
        for t in range(T - 1):
            cache = draft.new_cache()
            state = decoding.catch_up(
                draft, cache, batch.input_ids[0, : t + 1], batch.aux_hidden[0, : t + 1]
            )
            chain = decoding.propose(draft, cache, state, 3, 1, 0, 0.0, None).tokens.tolist()
            accepted = 0
            while accepted < min(3, T - 1 - t) and chain[accepted] == int(
                batch.target_ids[0, t + accepted]
            ):
                accepted += 1
            prefix = 0
            while prefix < min(3, T - 1 - t) and hit[prefix, t]:
                prefix += 1
            assert accepted == prefix, t


def test_activation_checkpointing_gives_the_same_loss_metrics_and_gradients():
    checkpointing_changes_nothing(
        lambda: dspark_draft(seed=3),
        lambda d, c: DSparkObjective(d, options(), activation_checkpointing=c),
    )


def test_the_confidence_head_runs_in_fp32_under_bf16_autocast_and_bf16_weights():
    """CUDA's training step: bf16 autocast, and FSDP2 gathers the weights in bf16; vLLM runs the head in fp32.
    The head's logit stays fp32 either way, and the loss is the fp32 loss to bf16 precision."""
    draft = dspark_draft(seed=4)
    batch = batch_for(draft, True)
    objective = DSparkObjective(draft, options())
    fp32 = objective(batch).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = objective(batch).loss
        h = torch.randn(3, draft.config.hidden_size, dtype=torch.bfloat16)
        e = torch.randn(3, RANK, dtype=torch.bfloat16)
        assert draft.confidence_logit(h, e).dtype == torch.float32
    half.backward()
    assert abs(float(half.detach()) - float(fp32.detach())) < 0.05 * float(fp32.detach())
    draft.confidence_head.to(torch.bfloat16)  # FSDP2's mixed-precision gather
    assert draft.confidence_logit(h.float(), e.float()).dtype == torch.float32


def test_without_the_confidence_head_or_its_markov_input():
    draft = dspark_draft(confidence=False)
    assert draft.confidence_head is None
    out = DSparkObjective(draft, options(confidence_head=False))(batch_for(draft, False))
    assert torch.isfinite(out.loss)
    draft = dspark_draft(with_markov=False)
    assert draft.confidence_head.proj.weight.shape == (1, draft.config.hidden_size)
    h = torch.randn(draft.config.hidden_size)
    torch.testing.assert_close(
        torch.sigmoid(draft.confidence_logit(h, torch.zeros(RANK))),
        ref_confidence(draft, h, 0, with_markov=False),
    )


def test_what_cannot_be_trained_or_served_is_refused():
    assert position_weights(3, 2.0) == [1.0, math.exp(-0.5), math.exp(-1.0)]
    with pytest.raises(ConfigError, match="Markov rank"):
        DSparkDraft(
            tiny_config(
                algorithm="dspark",
                mask_token_id=5,
                aux_layer_ids=[1, 2, 3, 5, 6],
                extra={"block_size": 3, "markov_rank": 0},
            )
        )
    draft = dspark_draft()
    with pytest.raises(ConfigError, match="--block-size 8 differs from the draft's 3"):
        DSparkObjective(draft, ObjectiveOptions(block_size=8, markov_rank=RANK))
    with pytest.raises(ConfigError, match="--markov-rank 4 differs"):
        DSparkObjective(draft, ObjectiveOptions(block_size=3, markov_rank=4))
    with pytest.raises(ConfigError, match="--loss lk-alpha does not apply to DSpark"):
        DSparkObjective(draft, options(loss="lk-alpha"))


def test_anchors_covering_every_slot_give_the_every_slot_objective():
    draft = dspark_draft(seed=5)
    batch = batch_for(draft, True)
    ref = DSparkObjective(draft, options())(batch)
    out = DSparkObjective(draft, options(max_anchors=10**4))(batch)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.correct, ref.correct) and torch.equal(out.total, ref.total)
