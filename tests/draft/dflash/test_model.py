"""DFlash's training layout and its decoding forward against an explicit reference written from vLLM
0.32's DFlashQwen3Model (context keys and values from hidden_norm(fc(aux)) through each layer's k/v
projections and k_norm, never its norms or MLP; the block [token, masks] as Qwen3 layers attending to all
the context before it and to the whole block), and the loss against its formula. The reference uses
plain tensor math: none of the grid layout, the TTT attention kernel or the draft's rope."""

import math

import pytest
import torch

from spec_cli.draft.dflash import decoding, default_aux_layers
from spec_cli.draft.dflash.model import DFlashDraft
from spec_cli.draft.dflash.objective import DFlashObjective, offset_weights
from spec_cli.errors import ConfigError
from spec_cli.train_options import ObjectiveOptions
from tests.draft import (
    one_thread,  # noqa: F401 (autouse fixture)
    random_batch,
    selected_ids,
    tiny_config,
)

N_AUX = 5


def dflash_draft(seed=0, size=4, layers=2, **overrides) -> DFlashDraft:
    torch.manual_seed(seed)
    config = tiny_config(
        algorithm="dflash",
        mask_token_id=5,
        aux_layer_ids=[1, 2, 3, 5, 6],
        num_hidden_layers=layers,
        extra={"block_size": size},
        **overrides,
    )
    return randomised(DFlashDraft(config))


def randomised(draft):
    """Norm weights away from 1 and a random embedding (a fresh draft's are ones and the target's copy)."""
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        draft.embed_tokens.weight.normal_()
    draft.set_vocab_map(selected_ids())
    return draft


def batch_for(draft, packed: bool, seed=0):
    if packed:
        batch = random_batch(draft.config, [20, 17], 20, seq_lens=[[9, 11], [6, 11]], seed=seed)
    else:
        batch = random_batch(draft.config, [14, 9], 14, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    B, T = batch.input_ids.shape
    batch.aux_hidden = torch.randn(B, T, N_AUX * draft.config.target_hidden_size, generator=gen)
    return batch


def _norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [n, heads, d]
    d = x.shape[-1]
    ang = pos[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = (
        torch.cat([ang, ang], -1).cos().float()[:, None],
        torch.cat([ang, ang], -1).sin().float()[:, None],
    )
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference_block(draft, aux_ctx, ctx_pos, ids, pos):
    """Final states [b, H] of one block: context aux_ctx [m, n*Ht] at ctx_pos [m], block ids/pos [b]."""
    cfg, eps = draft.config, draft.config.rms_norm_eps
    h_, kv_, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    c = _norm(aux_ctx @ draft.fc.weight.T, draft.hidden_norm.weight, eps)
    h = draft.embed_tokens.weight[ids]
    for layer in draft.layers:
        a = layer.self_attn
        kc = _rope(
            _norm((c @ a.k_proj.weight.T).view(-1, kv_, d), a.k_norm.weight, eps),
            ctx_pos,
            cfg.rope_theta,
        )
        vc = (c @ a.v_proj.weight.T).view(-1, kv_, d)
        x = _norm(h, layer.input_layernorm.weight, eps)
        q = _rope(
            _norm((x @ a.q_proj.weight.T).view(-1, h_, d), a.q_norm.weight, eps),
            pos,
            cfg.rope_theta,
        )
        kb = _rope(
            _norm((x @ a.k_proj.weight.T).view(-1, kv_, d), a.k_norm.weight, eps),
            pos,
            cfg.rope_theta,
        )
        vb = (x @ a.v_proj.weight.T).view(-1, kv_, d)
        k, v = (
            torch.cat([kc, kb]).repeat_interleave(h_ // kv_, 1),
            torch.cat([vc, vb]).repeat_interleave(h_ // kv_, 1),
        )
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(ids), -1)
        h = h + o @ a.o_proj.weight.T
        m = _norm(h, layer.post_attention_layernorm.weight, eps)
        h = (
            h
            + (
                torch.nn.functional.silu(m @ layer.mlp.gate_proj.weight.T)
                * (m @ layer.mlp.up_proj.weight.T)
            )
            @ layer.mlp.down_proj.weight.T
        )
    return _norm(h, draft.norm.weight, eps)


def _docs(batch):
    """[B, T] document index of each slot (-1: padding), positions [B, T]."""
    B, T = batch.input_ids.shape
    doc, pos = torch.full((B, T), -1), torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        lens = (
            batch.seq_lens[b].tolist()
            if batch.seq_lens is not None
            else [int(batch.attention_mask[b].sum())]
        )
        s = 0
        for i, n in enumerate(lens):
            doc[b, s : s + n], pos[b, s : s + n] = i, torch.arange(n)
            s += n
    return doc, pos


@pytest.mark.parametrize("packed", [False, True])
def test_every_slots_block_is_the_block_vllm_computes_there(packed):
    draft = dflash_draft()
    batch = batch_for(draft, packed)
    doc, pos = _docs(batch)
    size = draft.block_size
    with torch.no_grad():
        from spec_cli.draft.unroll import step_slots

        _, _, segments = step_slots(
            torch.ones(1, *batch.input_ids.shape, dtype=torch.bool),
            batch.attention_mask,
            batch.seq_lens,
        )
        states = draft.block_forward(batch.input_ids, batch.aux_hidden, pos, segments)
        assert len(states) == size - 1
        B, T = batch.input_ids.shape
        checked = 0
        for b in range(B):
            for t in range(T):
                if doc[b, t] < 0:
                    continue
                ctx = (doc[b] == doc[b, t]) & (torch.arange(T) <= t)
                ids = torch.tensor([int(batch.input_ids[b, t])] + [5] * (size - 1))
                want = reference_block(
                    draft,
                    batch.aux_hidden[b, ctx],
                    pos[b, ctx],
                    ids,
                    pos[b, t] + 1 + torch.arange(size),
                )
                got = torch.stack([s[b, t] for s in states])
                torch.testing.assert_close(got, want[1:], rtol=1e-4, atol=1e-4)
                checked += 1
        assert checked == int(batch.attention_mask.sum())


def test_decoding_adds_context_and_drafts_the_block_vllm_drafts():
    draft = dflash_draft(size=5)
    batch = batch_for(draft, False)
    aux, ids = batch.aux_hidden[0], batch.input_ids[0]
    with torch.no_grad():
        cache = draft.new_cache()
        state = decoding.catch_up(
            draft, cache, ids[:6], aux[:6]
        )  # slots 0..5, then 6..8 in a second call
        state = decoding.catch_up(draft, cache, ids[6:9], aux[6:9])
        assert len(cache) == 9 and state.position == 9 and int(state.token) == int(ids[8])
        got = draft.draft_block(
            torch.tensor([[int(ids[8]), 5, 5, 5]]), torch.arange(9, 13)[None], cache
        )[0]
        assert len(cache) == 9  # the block's keys never enter the cache
        want = reference_block(
            draft,
            aux[:9],
            torch.arange(9),
            torch.tensor([int(ids[8]), 5, 5, 5]),
            torch.arange(9, 13),
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        proposal = decoding.propose(draft, cache, state, 3, 1, 0, 0.0, None)
        assert (
            proposal.tokens.tolist()
            == draft.to_target_ids(draft.logits(want[1:]).argmax(-1)).tolist()
        )
        assert proposal.parents.tolist() == [-1, 0, 1] and proposal.chain
        with pytest.raises(ConfigError, match="at most 4 per forward"):
            decoding.propose(draft, cache, state, 5, 1, 0, 0.0, None)
        with pytest.raises(ConfigError, match="not a tree"):
            decoding.propose(draft, cache, state, 3, 2, 0, 0.0, None)


@pytest.mark.parametrize("packed", [False, True])
def test_the_loss_is_the_decayed_weighted_mean_of_soft_ce_over_supervised_elements(packed):
    draft = dflash_draft()
    batch = batch_for(draft, packed)
    doc, pos = _docs(batch)
    options = ObjectiveOptions(block_size=4, block_decay=2.0)
    objective = DFlashObjective(draft, options)
    out = objective(batch)
    with torch.no_grad():
        from spec_cli.draft.unroll import step_slots

        _, _, segments = step_slots(
            torch.ones(1, *batch.input_ids.shape, dtype=torch.bool),
            batch.attention_mask,
            batch.seq_lens,
        )
        states = draft.block_forward(batch.input_ids, batch.aux_hidden, pos, segments)
    B, T = batch.input_ids.shape
    num = den = 0.0
    for j in range(1, 4):
        w = math.exp(-(j - 1) / 2.0)
        hits = counted = supervised = 0
        losses = []
        for b in range(B):
            for t in range(T):
                # offset j proposes x[t + 1 + j]; the shifted batch's row s holds the target for x[s + 2]
                s = t + j - 1
                if doc[b, t] < 0 or s >= T or doc[b, s] != doc[b, t] or not batch.loss_mask[b, s]:
                    continue
                counted += 1
                logits = draft.logits(states[j - 1][b, t])
                hits += int(draft.to_target_ids(logits.argmax()) == batch.target_ids[b, s])
                if batch.position_mask[b, s]:
                    supervised += 1
                    losses.append(-(batch.target_p[b, s] * logits.log_softmax(-1)).sum())
        num += w * float(sum(losses).detach())
        den += w * supervised
        assert int(out.total[j - 1]) == counted and int(out.supervised[j - 1]) == supervised
        assert int(out.correct[j - 1]) == hits
        torch.testing.assert_close(
            out.step_loss[j - 1], torch.stack(losses).mean(), rtol=1e-5, atol=1e-6
        )
    torch.testing.assert_close(out.loss, torch.tensor(num / den), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    grads = {n: p.grad for n, p in draft.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), [
        n for n, g in grads.items() if g is None or g.abs().sum() == 0
    ]
    assert draft.embed_tokens.weight.grad is None


def test_activation_checkpointing_gives_the_same_loss_metrics_and_gradients():
    checkpointing_changes_nothing(
        lambda: dflash_draft(seed=3),
        lambda d, c: DFlashObjective(d, ObjectiveOptions(block_size=4), activation_checkpointing=c),
    )


def checkpointing_changes_nothing(make_draft, make_objective):
    """The objective with and without activation checkpointing: the same loss, metrics and gradients."""
    grads, outs = [], []
    for checkpoint in (False, True):
        draft = make_draft()
        out = make_objective(draft, checkpoint)(batch_for(draft, True))
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad})
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(outs[1].correct, outs[0].correct) and torch.equal(
        outs[1].supervised, outs[0].supervised
    )
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_bf16_autocast_trains_with_one_dtype_into_attention():
    """The CUDA training step's precision (bf16 autocast; CPU autocast runs the same casts): q and k come
    out of their per-head norms in the projections' dtype, so attention gets one dtype, and the loss is
    the fp32 loss to bf16 precision."""
    draft = dflash_draft(seed=4)
    batch = batch_for(draft, True)
    objective = DFlashObjective(draft, ObjectiveOptions(block_size=4))
    fp32 = objective(batch).loss
    seen = []
    from spec_cli.draft import attention

    original = attention.ttt_attention

    def spy(q, k0, v0, extra_k=(), extra_v=(), **kw):
        seen.append({t.dtype for t in (q, k0, v0, *extra_k, *extra_v)})
        return original(q, k0, v0, extra_k, extra_v, **kw)

    import spec_cli.draft.dflash.model as model

    model.ttt_attention = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = objective(batch).loss
        half.backward()
    finally:
        model.ttt_attention = original
    assert seen and all(s == {torch.bfloat16} for s in seen)
    assert abs(float(half.detach()) - float(fp32.detach())) < 0.05 * float(fp32.detach())
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all()
        for p in draft.parameters()
        if p.requires_grad
    )


def test_offset_weights_and_default_layers():
    assert offset_weights(4, 2.0) == [1.0, math.exp(-0.5), math.exp(-1.0)]
    assert default_aux_layers(36) == [1, 9, 17, 25, 33]  # the peers' Qwen3-8B DFlash layers
    assert default_aux_layers(30) == [1, 8, 14, 20, 27]
    # small targets: five distinct layers (vLLM captures each once), never the last layer's output
    assert default_aux_layers(6) == [0, 1, 2, 3, 4] and default_aux_layers(7) == [0, 1, 2, 4, 5]
    assert all(
        len(set(default_aux_layers(n))) == 5 and max(default_aux_layers(n)) <= n - 2
        for n in range(6, 80)
    )


def test_what_vllm_cannot_serve_is_refused_when_the_draft_is_built():
    with pytest.raises(ConfigError, match="mask token"):
        DFlashDraft(
            tiny_config(algorithm="dflash", aux_layer_ids=[1, 2, 3, 5, 6], extra={"block_size": 4})
        )
    with pytest.raises(ConfigError, match="no --fc-norm"):
        DFlashDraft(
            tiny_config(
                algorithm="dflash",
                mask_token_id=5,
                fc_norm=True,
                aux_layer_ids=[1, 2, 3, 5, 6],
                extra={"block_size": 4},
            )
        )
    with pytest.raises(ConfigError, match="at least 2"):
        DFlashDraft(
            tiny_config(
                algorithm="dflash",
                mask_token_id=5,
                aux_layer_ids=[1, 2, 3, 5, 6],
                extra={"block_size": 1},
            )
        )
    draft = dflash_draft()
    with pytest.raises(ConfigError, match="differs from the draft.s 4"):
        DFlashObjective(draft, ObjectiveOptions(block_size=8))


def test_training_scores_each_offset_on_the_token_decoding_proposes_there():
    """The objective's alignment checked against decoding (itself checked against vLLM's computation
    above): a row is built so that the block anchored at slot 5 proposes exactly the row's next tokens,
    the supervision is assembled from the unshifted row as every target backend does, and the objective's
    top-1 hits per offset must equal the hits counted by running `propose` from every slot."""
    from spec_cli.targets.supervision import assemble_batch

    torch.manual_seed(0)
    config = tiny_config(
        algorithm="dflash",
        mask_token_id=5,
        aux_layer_ids=[1, 2, 3, 5, 6],
        num_hidden_layers=2,
        draft_vocab_size=64,
        extra={"block_size": 4},
    )
    draft = DFlashDraft(config)
    with torch.no_grad():  # weights large enough that the proposals vary with the position
        for p in draft.parameters():
            p.normal_(0, 1 if p.dim() < 2 else 2 / p.shape[1] ** 0.5)
    draft.set_vocab_map(torch.arange(64))
    T, t0, K = 16, 5, 3
    gen = torch.Generator().manual_seed(1)
    aux = torch.randn(T, N_AUX * config.target_hidden_size, generator=gen)
    x = torch.randint(0, 64, (T,), generator=gen)

    def proposals(t):  # the block anchored at slot t: context 0..t, first token x[t + 1]
        cache = draft.new_cache()
        state = decoding.catch_up(draft, cache, x[1 : t + 2], aux[: t + 1])
        return decoding.propose(draft, cache, state, K, 1, 0, 0.0, None).tokens

    with torch.no_grad():
        x[t0 + 2 : t0 + 2 + K] = proposals(t0)  # x[t0 + 1 + j] is what offset j proposes
        assert (
            len(set(x[t0 + 1 : t0 + 3 + K].tolist())) == K + 2
        )  # distinct: a shifted reading cannot match
        argmax = torch.cat([x[1:], x[:1]])  # the target at position p predicts x[p + 1]
        ones = torch.ones(1, T, dtype=torch.long)
        batch = assemble_batch(
            aux[None],
            x[None],
            ones,
            ones,
            torch.nn.functional.one_hot(argmax, 64)[None].float(),
            torch.ones(1, T),
            argmax[None],
            torch.ones(64, dtype=torch.bool),
        )
        out = DFlashObjective(draft, ObjectiveOptions(block_size=4))(batch)
        want = [0] * K
        for t in range(T - 1):
            tokens = proposals(t)
            for j in range(1, K + 1):
                if t + 1 + j < T:  # the token exists (the last position predicts nothing)
                    want[j - 1] += int(tokens[j - 1] == x[t + 1 + j])
    assert all(w >= 1 for w in want)  # at least slot t0's
    assert out.correct.tolist() == want, (out.correct.tolist(), want)


def test_spec_eval_depth_defaults_to_what_one_block_forward_proposes():
    """`spec eval` without --depth: a DFlash draft of block size B proposes B - 1 tokens per forward (what
    its export's serve command uses); every other draft a chain of 3."""
    from spec_cli.stages.eval import natural_depth
    from tests.draft import tiny_config

    assert natural_depth(tiny_config(algorithm="dflash", extra={"block_size": 8})) == 7
    assert natural_depth(tiny_config(algorithm="dflash", extra={"block_size": 4})) == 3
    assert natural_depth(tiny_config()) == 3


@pytest.mark.parametrize("packed", [False, True])
def test_anchored_blocks_are_the_every_slot_blocks_at_their_anchors(packed):
    """--max-anchors: anchor_forward at some slots gives block_forward's states there (its mask: the anchor's
    own document up to it, and its own block), and the objective over every eligible slot as anchors gives
    the every-slot objective's loss and metrics."""
    from spec_cli.draft.dflash.objective import doc_starts
    from spec_cli.draft.unroll import step_slots

    draft = dflash_draft()
    batch = batch_for(draft, packed)
    doc, pos = _docs(batch)
    with torch.no_grad():
        _, _, segments = step_slots(
            torch.ones(1, *batch.input_ids.shape, dtype=torch.bool),
            batch.attention_mask,
            batch.seq_lens,
        )
        every = draft.block_forward(batch.input_ids, batch.aux_hidden, pos, segments)
        anchors = torch.tensor([[0, 5, 8, 13], [1, 9, 10, 12]])
        anchored = draft.anchor_forward(
            batch.input_ids, batch.aux_hidden, pos, anchors, doc_starts(batch)
        )
    for j in range(3):
        want = every[j].gather(1, anchors[..., None].expand(-1, -1, every[j].shape[-1]))
        torch.testing.assert_close(anchored[j], want, rtol=1e-4, atol=1e-5)
    ref = DFlashObjective(draft, ObjectiveOptions(block_size=4))(batch)
    out = DFlashObjective(draft, ObjectiveOptions(block_size=4, max_anchors=10**4))(batch)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.correct, ref.correct) and torch.equal(out.total, ref.total)
    assert torch.equal(out.supervised, ref.supervised)
    torch.manual_seed(0)
    few = DFlashObjective(draft, ObjectiveOptions(block_size=4, max_anchors=3))(batch)
    assert (
        (few.total <= 2 * 3).all() and int(few.total.sum()) > 0 and torch.isfinite(few.loss)
    )  # 3 a row
    torch.manual_seed(0)
    again = DFlashObjective(draft, ObjectiveOptions(block_size=4, max_anchors=3))(batch)
    assert torch.equal(
        again.loss, few.loss
    )  # the CPU generator's state decides the anchors (checkpointed)
    with torch.autocast(
        "cpu", dtype=torch.bfloat16
    ):  # CUDA's training precision: one dtype into SDPA
        torch.manual_seed(0)
        half = DFlashObjective(draft, ObjectiveOptions(block_size=4, max_anchors=3))(batch)
    assert abs(float(half.loss.detach()) - float(few.loss.detach())) < 0.05 * float(
        few.loss.detach()
    )
