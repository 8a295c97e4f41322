"""EAGLE-1/2's loss against an independent computation: SmoothL1 on the predicted next feature plus
0.1 x soft-CE through the target's lm_head (EAGLE-1's train/main.py), its gradients, the unroll's second
step against decoding slot by slot (each slot reads its own predicted feature, as served), top-1 counts,
and the error for supervision without final hidden states."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from spec_cli.batch import TargetBatch
from spec_cli.draft.decoding import catch_up
from spec_cli.draft.eagle.objective import EagleObjective, eagle_forward
from spec_cli.errors import ConfigError
from spec_cli.train_options import ObjectiveOptions
from tests.draft import one_thread  # noqa: F401 (autouse fixture)
from tests.draft.eagle.test_model import H, V, eagle_draft, reference


def batch_of(lengths: list[int], T: int, seed: int = 0) -> TargetBatch:
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    attention_mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    loss_mask = (torch.rand(B, T, generator=gen) < 0.8).long() * attention_mask
    loss_mask[torch.arange(B), torch.tensor(lengths) - 1] = 0
    logits = torch.randn(B, T, V, generator=gen) * 2
    return TargetBatch(
        aux_hidden=torch.zeros(B, T, 0),
        input_ids=torch.randint(0, V, (B, T), generator=gen),
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        target_p=logits.softmax(-1),
        position_mask=loss_mask.bool(),
        target_ids=logits.argmax(-1),
        target_mass=torch.ones(B, T),
        final_hidden=torch.randn(B, T, H, generator=gen),
    )


def expected_step0(draft, batch: TargetBatch, token_weight: float = 0.1):
    """(loss, hits) of the one-step EAGLE-1 loss computed row by row with the reference forward."""
    W = {k: v.detach() for k, v in draft.state_dict().items()}
    feature, token, hits, n = 0.0, 0.0, 0, 0
    for b in range(batch.input_ids.shape[0]):
        T = int(batch.attention_mask[b].sum())
        state, logits = reference(
            W, draft.config, batch.input_ids[b, :T], batch.final_hidden[b, :T]
        )
        for t in batch.loss_mask[b, :T].nonzero().flatten().tolist():
            feature += F.smooth_l1_loss(state[t], batch.final_hidden[b, t + 1])
            token += -(batch.target_p[b, t] * logits[t].log_softmax(-1)).sum()
            hits += int(logits[t].argmax() == batch.target_ids[b, t])
            n += 1
    return feature / n + token_weight * token / n, hits


def test_one_step_is_eagle1s_training_step():
    draft = eagle_draft(num_hidden_layers=2)
    batch = batch_of([9, 6], T=10)
    out = eagle_forward(draft, batch, ttt_steps=1)
    loss, hits = expected_step0(draft, batch)
    torch.testing.assert_close(
        out.loss, torch.as_tensor(loss, dtype=torch.float32), rtol=1e-5, atol=1e-6
    )
    assert int(out.correct[0]) == hits and int(out.total[0]) == int(batch.loss_mask.sum())
    heavier = eagle_forward(draft, batch, ttt_steps=1, token_weight=1.0).loss
    torch.testing.assert_close(
        heavier,
        torch.as_tensor(expected_step0(draft, batch, 1.0)[0], dtype=torch.float32),
        rtol=1e-5,
        atol=1e-6,
    )


def test_gradients_are_the_reference_losss():
    draft = eagle_draft()
    batch = batch_of([7, 5], T=8, seed=1)
    eagle_forward(draft, batch, ttt_steps=1).loss.backward()
    got = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    params = {
        n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in draft.named_parameters()
    }
    W = dict(params)
    feature, token, n = 0.0, 0.0, 0
    for b in range(2):
        T = int(batch.attention_mask[b].sum())
        state, logits = reference(
            W, draft.config, batch.input_ids[b, :T], batch.final_hidden[b, :T]
        )
        for t in batch.loss_mask[b, :T].nonzero().flatten().tolist():
            feature = feature + F.smooth_l1_loss(state[t], batch.final_hidden[b, t + 1])
            token = token - (batch.target_p[b, t] * logits[t].log_softmax(-1)).sum()
            n += 1
    (feature / n + 0.1 * token / n).backward()
    assert got.keys() == {k for k, p in params.items() if p.requires_grad}
    for name, grad in got.items():
        torch.testing.assert_close(grad, params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert (
        draft.embed_tokens.weight.grad is None and draft.lm_head.weight.grad is None
    )  # the target's


def test_the_second_step_reads_the_drafts_own_feature_as_decoding_does():
    draft = eagle_draft(num_hidden_layers=2).eval()
    batch = batch_of([10], T=10, seed=2)
    with torch.no_grad():
        out = eagle_forward(draft, batch, ttt_steps=2, step_weight=1.0)
    ids, feats, T = batch.input_ids[0], batch.final_hidden[0], 10
    losses = []
    with torch.no_grad():
        for t in range(T - 1):
            if not (
                batch.loss_mask[0, t + 1] and t + 3 <= T
            ):  # step 1 supervises t at t + 1 (in the row)
                continue
            cache = draft.new_cache()
            state = catch_up(
                draft, cache, ids[: t + 1], feats[: t + 1]
            )  # step 0 of slot t, true features
            state = draft.forward_step(
                ids[t + 1].view(1, 1), state, torch.tensor([[t + 1]]), cache
            )[0, 0]
            losses.append(
                F.smooth_l1_loss(state, feats[t + 2])
                - 0.1 * (batch.target_p[0, t + 1] * draft.logits(state).log_softmax(-1)).sum()
            )
    torch.testing.assert_close(out.step_loss[1], torch.stack(losses).mean(), rtol=1e-5, atol=1e-6)


def test_supervision_without_final_hidden_states_and_lk_losses_are_refused():
    draft = eagle_draft()
    batch = dataclasses.replace(batch_of([5], T=6), final_hidden=None)
    with pytest.raises(ConfigError, match="final hidden states"):
        eagle_forward(draft, batch)
    with pytest.raises(ConfigError, match="--loss lk-alpha"):
        EagleObjective(draft, ObjectiveOptions(loss="lk-alpha"))


@pytest.mark.parametrize("ttt_steps", [1, 3])
def test_checkpointing_with_the_chunked_full_vocab_head_gives_the_same_loss_and_gradients(
    ttt_steps, monkeypatch
):
    """With activation checkpointing the full-vocabulary head runs chunk by chunk of positions
    (several chunks here); loss, top-1 hits and gradients stay those of the plain head."""
    from spec_cli.draft import losses

    monkeypatch.setattr(losses, "HEAD_CHUNK_BYTES", 4 * V * 3)  # three positions per chunk
    draft = eagle_draft()
    batch = batch_of([9, 7], 9)
    params = [p for p in draft.parameters() if p.requires_grad]
    outs, grads = [], []
    for checkpoint in (False, True):
        out = eagle_forward(draft, batch, ttt_steps=ttt_steps, checkpoint=checkpoint)
        outs.append(out)
        grads.append(torch.autograd.grad(out.loss, params))
    torch.testing.assert_close(outs[1].loss, outs[0].loss, atol=1e-6, rtol=1e-6)
    assert torch.equal(outs[1].correct, outs[0].correct)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
