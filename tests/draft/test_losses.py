"""Losses and metrics against hand / independent computations."""

import pytest
import torch

from spec_cli.draft.losses import (
    acceptance,
    acceptance_length,
    lk_alpha_loss,
    soft_cross_entropy,
    step_loss,
    step_weights,
    top1_correct,
)
from tests.draft import one_thread  # noqa: F401 (autouse fixture)


def _dist(N=6, Vd=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, Vd, generator=gen, dtype=torch.float64, requires_grad=True)
    target_p = torch.randn(N, Vd, generator=gen, dtype=torch.float64).softmax(-1)
    return logits, target_p


def test_soft_ce_is_kl_plus_target_entropy():
    logits, target_p = _dist()
    q = logits.softmax(-1)
    kl = (target_p * (target_p.log() - q.log())).sum(-1).mean()
    entropy = -(target_p * target_p.log()).sum(-1).mean()
    torch.testing.assert_close(soft_cross_entropy(logits, target_p), kl + entropy)


def test_soft_ce_value_and_gradient_match_the_plain_formula():
    logits, target_p = _dist()
    target_p = target_p * 0.7  # rows need not sum to 1 (e.g. rolled-in zeros)
    plain = -(target_p * logits.log_softmax(-1)).sum(-1).mean()
    value = soft_cross_entropy(logits, target_p)
    torch.testing.assert_close(value, plain)
    torch.testing.assert_close(
        torch.autograd.grad(3 * value, logits)[0], torch.autograd.grad(3 * plain, logits)[0]
    )


def test_soft_ce_of_one_hot_is_cross_entropy():
    logits, _ = _dist()
    labels = torch.tensor([0, 3, 9, 2, 2, 5])
    one_hot = torch.nn.functional.one_hot(labels, 10).double()
    torch.testing.assert_close(
        soft_cross_entropy(logits, one_hot), torch.nn.functional.cross_entropy(logits, labels)
    )


def test_alpha_of_identical_distributions_is_one():
    logits, _ = _dist()
    p = logits.detach().softmax(-1)
    torch.testing.assert_close(
        acceptance(logits, p, torch.ones(6, dtype=torch.float64)),
        torch.ones(6, dtype=torch.float64),
    )
    assert (
        float(lk_alpha_loss(acceptance(logits, p, torch.ones(6, dtype=torch.float64))).detach())
        < 1e-12
    )


def test_alpha_uses_the_full_vocab_normaliser():
    """Half the target's mass is outside the draft vocab: alpha of a matching draft is 1/2."""
    logits, _ = _dist()
    p = logits.detach().softmax(-1)
    alpha = acceptance(logits, p, torch.full((6,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(alpha, torch.full((6,), 0.5, dtype=torch.float64))


def test_alpha_is_one_minus_total_variation():
    logits, target_p = _dist()
    q = logits.softmax(-1)
    tv = 0.5 * (target_p - q).abs().sum(-1)
    torch.testing.assert_close(
        acceptance(logits, target_p, torch.ones(6, dtype=torch.float64)), 1 - tv
    )


def test_lk_alpha_skips_zero_acceptance_without_nan():
    alpha = torch.tensor([0.5, 0.0, 0.25], dtype=torch.float64, requires_grad=True)
    value = lk_alpha_loss(alpha)
    torch.testing.assert_close(
        value, -(torch.tensor(0.5).log() + torch.tensor(0.25).log()).double() / 3
    )
    value.backward()
    assert torch.isfinite(alpha.grad).all() and alpha.grad[1] == 0


def test_lk_lambda_weights():
    logits, target_p = _dist()
    mass = torch.full((6,), 0.9, dtype=torch.float64)
    ce = soft_cross_entropy(logits, target_p)
    alpha = acceptance(logits, target_p, mass)
    w = 2.0 * torch.exp(-0.5 * alpha.mean())
    expected = w * ce + (1 - w) * (1 - alpha.mean())
    got = step_loss(logits, target_p, mass, "lk-lambda", kl_scale=2.0, kl_decay=0.5)
    torch.testing.assert_close(got, expected)
    # w is a constant: the gradient is w * d(ce) - (1 - w) * d(mean alpha)
    (g,) = torch.autograd.grad(got, logits)
    g_ce = torch.autograd.grad(soft_cross_entropy(logits, target_p), logits)[0]
    g_alpha = torch.autograd.grad(acceptance(logits, target_p, mass).mean(), logits)[0]
    torch.testing.assert_close(g, w.detach() * g_ce - (1 - w.detach()) * g_alpha)


def test_no_supervised_positions_gives_zero_and_zero_gradient():
    logits = torch.zeros(0, 10, requires_grad=True)
    for loss in ("soft-ce", "lk-alpha", "lk-lambda"):
        value = step_loss(logits, torch.zeros(0, 10), torch.zeros(0), loss)
        assert float(value.detach()) == 0.0
        (g,) = torch.autograd.grad(value, logits, allow_unused=True)
        assert g is None or torch.isfinite(g).all()


def test_accuracy_maps_draft_ids_through_d2t():
    """The draft's argmax is draft id 1, which is target id 7 only through d2t."""
    selected = torch.tensor([2, 7, 9])
    d2t = selected - torch.arange(3)  # offsets
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    assert int(top1_correct(logits, d2t, torch.tensor([7, 2]))) == 2
    assert int(top1_correct(logits, d2t, torch.tensor([1, 0]))) == 0  # raw draft ids never count


def test_step_weights_and_acceptance_length():
    w = step_weights(3, 0.5)
    torch.testing.assert_close(torch.tensor(w), torch.tensor([4, 2, 1]) / 7.0)
    assert abs(sum(step_weights(7, 0.8)) - 1) < 1e-12
    acc = torch.tensor([0.8, 0.5, 0.5], dtype=torch.float64)
    assert abs(float(acceptance_length(acc)) - (1 + 0.8 + 0.4 + 0.2)) < 1e-12


def _head_case(dtype=torch.float64, B=2, T=9, H=6, V=11, seed=0):
    from spec_cli.draft.layers import RMSNorm

    gen = torch.Generator().manual_seed(seed)
    norm, head = RMSNorm(H, 1e-6), torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=gen))
        head.weight.copy_(torch.randn(V, H, generator=gen))
    norm.to(dtype), head.to(dtype)
    state = torch.randn(B, T, H, generator=gen, dtype=dtype).requires_grad_()
    target_p = (
        torch.randn(B, T, V, generator=gen, dtype=dtype).softmax(-1) * 0.9
    )  # mass 0.9 over the draft vocab
    b = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 1, 1])
    t = torch.tensor([0, 2, 5, 0, 1, 3, 4, 6, 6, 2])
    return norm, head, state, target_p, b, t


@pytest.mark.parametrize("chunk_rows", [1, 3, 10, 64])
def test_chunked_soft_ce_matches_the_plain_head(chunk_rows):
    """Loss, argmax and every gradient (state, norm and head weights) as the whole-[N, V] head, for
    chunks that split N unevenly, one per position, and one for all."""
    from spec_cli.draft.losses import chunked_soft_ce

    norm, head, state, target_p, b, t = _head_case()
    k = 2
    params = [head.weight, norm.weight]
    logits = head(norm(state[b, t]))
    ref = soft_cross_entropy(logits, target_p[b, t + k])
    ref_grads = torch.autograd.grad(ref, [state, *params])
    loss, argmax = chunked_soft_ce(
        lambda x: head(norm(x)), state, (b, t), target_p, (b, t + k), 11, chunk_rows=chunk_rows
    )
    grads = torch.autograd.grad(loss, [state, *params])
    torch.testing.assert_close(loss, ref, atol=1e-12, rtol=1e-12)
    assert torch.equal(argmax, logits.argmax(-1))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12)


def test_chunked_soft_ce_keeps_no_position_by_vocab_tensor():
    """What forward keeps for backward: the plain head keeps an [N, V] gradient (the test can fail);
    the chunked one keeps the inputs it was given and the chunks' indices, nothing [N, V]."""
    from spec_cli.draft.losses import chunked_soft_ce

    norm, head, state, target_p, b, t = _head_case(dtype=torch.float32, V=64)
    N, V = b.numel(), 64
    made = []  # saved tensors that the call itself made (not its inputs: those live on anyway)

    def pack(x):
        made.append(tuple(x.shape))
        return x

    inputs = {id(x) for x in (state, target_p, b, t, head.weight, norm.weight)}

    def run(f):
        made.clear()
        with torch.autograd.graph.saved_tensors_hooks(
            lambda x: pack(x) if id(x) not in inputs else x, lambda x: x
        ):
            f()
        return [s for s in made if len(s) == 2 and s[0] == N and s[1] == V]

    assert run(lambda: soft_cross_entropy(head(norm(state[b, t])), target_p[b, t]))
    assert not run(
        lambda: chunked_soft_ce(
            lambda x: head(norm(x)), state, (b, t), target_p, (b, t), V, chunk_rows=4
        )
    )


def test_chunked_soft_ce_under_bf16_autocast_is_the_plain_heads():
    """The GPU path's autocast, on CPU: the matmuls run in bf16 in forward and in the recompute, the
    softmax in fp32; loss and gradients agree with the plain head's at bf16's tolerance, in the
    parameters' dtypes."""
    from spec_cli.draft.losses import chunked_soft_ce

    norm, head, state, target_p, b, t = _head_case(dtype=torch.float32, V=64)
    params = [head.weight, norm.weight]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = soft_cross_entropy(head(norm(state[b, t])), target_p[b, t + 1])
        loss, _ = chunked_soft_ce(
            lambda x: head(norm(x)), state, (b, t), target_p, (b, t + 1), 64, chunk_rows=3
        )
    ref_grads = torch.autograd.grad(ref, [state, *params])
    grads = torch.autograd.grad(loss, [state, *params])
    torch.testing.assert_close(loss, ref, atol=2e-2, rtol=2e-2)
    for g, r, x in zip(grads, ref_grads, [state, *params]):
        assert g.dtype == x.dtype
        torch.testing.assert_close(g, r, atol=2e-2, rtol=5e-2)


def test_chunked_soft_ce_of_no_positions_is_zero_with_zero_gradients():
    from spec_cli.draft.losses import chunked_soft_ce

    norm, head, state, target_p, _, _ = _head_case()
    none = torch.zeros(0, dtype=torch.long)
    loss, argmax = chunked_soft_ce(
        lambda x: head(norm(x)), state, (none, none), target_p, (none, none), 11
    )
    grads = torch.autograd.grad(loss, [state, head.weight])
    assert loss.item() == 0 and argmax.numel() == 0
    assert all(torch.count_nonzero(g) == 0 for g in grads)
