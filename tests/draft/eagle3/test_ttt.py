"""The TTT unroll against an independent, slow reference written from docs/eagle.md ("TTT unroll").

The reference reads the draft's weights by their engine names and recomputes everything plainly:
full [B, h, T, T + k] scores per step (SpecForge's `cache_hidden` recurrence, positions t + k at
step k as SpecForge and every serving engine use them), full [B, T, Vd]
logits, supervision rolled with explicit per-slot document checks. Loss, metrics and the gradients
of every trainable parameter must match `ttt_forward`.
"""

import math

import pytest
import torch

from spec_cli.draft.eagle3.ttt import ttt_forward
from spec_cli.draft.losses import acceptance_length
from spec_cli.draft.unroll import doc_remaining, packed_positions, shift_left
from tests.draft import (
    one_thread,  # noqa: F401 (autouse fixture)
    random_batch,
    selected_ids,
    tiny_draft,
)


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):  # x [B, h, T, d], pos [B, T]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[..., None].float() * inv  # [B, T, d/2]
    cos, sin = (
        ang.cos().repeat(1, 1, 2)[:, None].to(x.dtype),
        ang.sin().repeat(1, 1, 2)[:, None].to(x.dtype),
    )
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def documents(batch):
    """[B, T] document id per slot (padding: -1), slot by slot."""
    B, T = batch.input_ids.shape
    doc = torch.full((B, T), -1)
    for b in range(B):
        if batch.seq_lens is not None:
            docs = batch.seq_lens[b].tolist()
        else:
            docs = [int(batch.attention_mask[b].sum())]
        start = 0
        for i, n in enumerate(docs):
            doc[b, start : start + n] = i
            start += n
    return doc


def reference_ttt(draft, batch, steps, step_weight, loss="soft-ce"):
    cfg = draft.config
    P = dict(draft.named_parameters())
    eps, B, T = cfg.rms_norm_eps, *batch.input_ids.shape
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    doc = documents(batch)
    pos = batch.position_ids if batch.position_ids is not None else torch.arange(T).expand(B, T)
    same = (doc[:, :, None] == doc[:, None, :]) | (doc[:, :, None] < 0) & (doc[:, None, :] < 0)
    allowed = same & torch.ones(T, T, dtype=torch.bool).tril()  # [B, T, T]

    aux = batch.aux_hidden
    if cfg.fc_norm:
        aux = torch.cat(
            [rms(c, P[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(aux.chunk(3, -1))], -1
        )
    hidden = aux @ P["fc.weight"].T
    names = ["midlayer"] + [f"layers.{i}" for i in range(1, cfg.num_hidden_layers)]
    cache = {n: ([], []) for n in names}
    weights = [step_weight**k for k in range(steps)]
    total, out = 0.0, []
    for k in range(steps):
        ids = torch.zeros_like(batch.input_ids)
        ids[:, : T - k] = batch.input_ids[:, k:]
        x = hidden
        for li, n in enumerate(names):
            if li == 0:
                emb = draft.embed_tokens.weight[ids]
                inp = torch.cat(
                    [
                        rms(emb, P[f"{n}.input_layernorm.weight"], eps),
                        rms(x, P[f"{n}.hidden_norm.weight"], eps),
                    ],
                    -1,
                )
            else:
                inp = rms(x, P[f"{n}.input_layernorm.weight"], eps)
            q = (inp @ P[f"{n}.self_attn.q_proj.weight"].T).view(B, T, h, d).transpose(1, 2)
            kk = (inp @ P[f"{n}.self_attn.k_proj.weight"].T).view(B, T, kvh, d).transpose(1, 2)
            vv = (inp @ P[f"{n}.self_attn.v_proj.weight"].T).view(B, T, kvh, d).transpose(1, 2)
            q, kk = rope(q, pos + k, cfg.rope_theta), rope(kk, pos + k, cfg.rope_theta)
            ks, vs = cache[n]
            ks.append(kk.repeat_interleave(h // kvh, 1))
            vs.append(vv.repeat_interleave(h // kvh, 1))
            scores = q @ ks[0].transpose(-1, -2) / math.sqrt(d)  # [B, h, T, T]
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            diag = [
                (q * kj).sum(-1, keepdim=True) / math.sqrt(d) for kj in ks[1:]
            ]  # [B, h, T, 1] each
            p = torch.cat([scores, *diag], -1).softmax(-1)  # [B, h, T, T + k]
            o = p[..., :T] @ vs[0] + sum(
                p[..., T + j - 1 : T + j] * vs[j] for j in range(1, len(vs))
            )
            x = x + o.transpose(1, 2).reshape(B, T, h * d) @ P[f"{n}.self_attn.o_proj.weight"].T
            m = rms(x, P[f"{n}.post_attention_layernorm.weight"], eps)
            gate, up = m @ P[f"{n}.mlp.gate_proj.weight"].T, m @ P[f"{n}.mlp.up_proj.weight"].T
            g = torch.nn.functional.silu(gate) * up
            x = x + g @ P[f"{n}.mlp.down_proj.weight"].T
        normed = rms(x, P["norm.weight"], eps)
        hidden = normed if cfg.norm_output else x
        logits = normed @ P["lm_head.weight"].T  # [B, T, Vd]

        # supervision for slot t at step k comes from t + k, inside t's document
        valid = torch.zeros(B, T, dtype=torch.bool)
        for b in range(B):
            for t in range(T - k):
                valid[b, t] = doc[b, t] >= 0 and doc[b, t + k] == doc[b, t]
        pm = torch.zeros(B, T, dtype=torch.bool)
        lm = torch.zeros(B, T, dtype=torch.bool)
        pm[:, : T - k] = batch.position_mask[:, k:].bool()
        lm[:, : T - k] = batch.loss_mask[:, k:].bool()
        pm, lm = pm & valid, lm & valid
        tp = torch.zeros_like(batch.target_p)
        tp[:, : T - k] = batch.target_p[:, k:]
        mass = torch.zeros_like(batch.target_mass)
        mass[:, : T - k] = batch.target_mass[:, k:]
        tid = torch.full_like(batch.target_ids, -1)
        tid[:, : T - k] = batch.target_ids[:, k:]

        logp = logits.log_softmax(-1)
        n_sup = pm.sum()
        ce = -(tp * logp).sum(-1)
        alpha = torch.minimum(tp * mass[..., None], logp.exp()).sum(-1)
        if loss == "soft-ce":
            value = (ce * pm).sum() / n_sup.clamp_min(1)
        elif loss == "lk-alpha":
            value = -torch.where(pm, alpha, 1.0).log().sum() / n_sup.clamp_min(1)
        else:
            mean_alpha = (alpha * pm).sum() / n_sup.clamp_min(1)
            w = torch.exp(-mean_alpha.detach())
            value = w * (ce * pm).sum() / n_sup.clamp_min(1) + (1 - w) * (1 - mean_alpha)
        draft_ids = logits.argmax(-1)
        hits = ((draft_ids + draft.d2t[draft_ids] == tid) & lm).sum()
        total = total + weights[k] / sum(weights) * value
        out.append((value.detach(), hits, lm.sum(), n_sup))
    return total, out


CASES = {  # name: (draft options, lengths, T, seq_lens, steps)
    "padding-gqa-7": (dict(), [13, 9], 13, None, 7),
    "steps-1": (dict(), [13, 9], 13, None, 1),
    "packing-7": (dict(), [14, 12], 14, [[5, 9], [4, 3, 5]], 7),
    "fc_norm-norm_output": (dict(fc_norm=True, norm_output=True), [12, 7], 12, None, 4),
    "two-layers-packing": (
        dict(num_hidden_layers=2, num_key_value_heads=1),
        [12, 11],
        12,
        [[6, 6], [3, 8]],
        5,
    ),
}


def _trainable(draft):
    return [(n, p) for n, p in draft.named_parameters() if p.requires_grad]


def _compare(draft, batch, steps, loss="soft-ce", tol=None, **kwargs):
    params = _trainable(draft)
    ref_loss, ref_steps = reference_ttt(draft, batch, steps, 0.8, loss)
    ref_grads = torch.autograd.grad(ref_loss, [p for _, p in params], allow_unused=True)
    out = ttt_forward(draft, batch, ttt_steps=steps, step_weight=0.8, loss=loss, **kwargs)
    grads = torch.autograd.grad(out.loss, [p for _, p in params], allow_unused=True)
    tol = tol or dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.loss, ref_loss, **tol)
    ref_step_loss = torch.stack([s[0] for s in ref_steps]).to(out.step_loss.dtype)
    torch.testing.assert_close(out.step_loss, ref_step_loss, **tol)
    assert out.correct.tolist() == [int(s[1]) for s in ref_steps]
    assert out.total.tolist() == [int(s[2]) for s in ref_steps]
    assert out.supervised.tolist() == [int(s[3]) for s in ref_steps]
    for (name, _), g, r in zip(params, grads, ref_grads):
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g, r, **tol, msg=lambda m: f"{name}: {m}")
    return out


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_fp32(case):
    options, lengths, T, seq_lens, steps = CASES[case]
    draft = tiny_draft(**options)
    batch = random_batch(draft.config, lengths, T, seq_lens)
    out = _compare(draft, batch, steps)
    assert (
        out.supervised.sum() > 0 and out.total[0] > out.supervised[0] > 0
    )  # some out-of-vocab targets


@pytest.mark.parametrize("case", ["padding-gqa-7", "packing-7", "two-layers-packing"])
@pytest.mark.parametrize("impl", ["fused", "math"])
def test_matches_reference_fp64(case, impl):
    options, lengths, T, seq_lens, steps = CASES[case]
    draft = tiny_draft(dtype=torch.float64, **options)
    draft.attn_impl = impl
    batch = random_batch(draft.config, lengths, T, seq_lens, dtype=torch.float64)
    _compare(draft, batch, steps, tol=dict(atol=1e-10, rtol=1e-9))


@pytest.mark.parametrize("loss", ["lk-alpha", "lk-lambda"])
def test_lk_losses_match_reference(loss):
    draft = tiny_draft(dtype=torch.float64)
    batch = random_batch(draft.config, [13, 9], 13, dtype=torch.float64)
    _compare(draft, batch, 3, loss=loss, tol=dict(atol=1e-10, rtol=1e-9))


def test_checkpointing_gives_the_same_loss_and_gradients():
    draft = tiny_draft(dtype=torch.float64, num_hidden_layers=2)
    batch = random_batch(draft.config, [12, 11], 12, [[6, 6], [3, 8]], dtype=torch.float64)
    _compare(draft, batch, 4, checkpoint=True, tol=dict(atol=1e-10, rtol=1e-9))


DOCS = [4, 6, 5]  # one packed row of three documents


def unshifted_documents(config, masks: str, seed: int = 0) -> dict:
    """What a target backend has before assembly, for the documents DOCS back to back: aux states, ids,
    the target's distribution, mass and argmax at every position (unshifted), and the loss mask:
    "text" records carry loss on every token (a document's first token too), "chat" records begin
    with an unsupervised turn (the first two tokens of each document)."""
    gen = torch.Generator().manual_seed(seed)
    T, V = sum(DOCS), config.vocab_size
    sel = selected_ids()
    logits = torch.randn(1, T, V, generator=gen, dtype=torch.float64) * 2
    logits[..., sel] += 1.5
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[sel] = True
    loss = torch.ones(1, T, dtype=torch.long)
    if masks == "chat":
        for start in (0, 4, 10):
            loss[0, start : start + 2] = 0
    return {
        "aux": torch.randn(1, T, 3 * config.target_hidden_size, generator=gen),
        "ids": torch.randint(0, V, (1, T), generator=gen),
        "loss": loss,
        "p": logits[..., sel].softmax(-1).float(),
        "argmax": logits.argmax(-1),
        "t2d": t2d,
        "mass": (logits[..., sel].logsumexp(-1) - logits.logsumexp(-1)).exp().float(),
    }


def assembled(u: dict, rows: list[slice], seq_lens: list[list[int]] | None = None):
    """assemble_batch over `rows` (slices of the documents' tokens), right-padded; packed with seq_lens."""
    from spec_cli.targets.supervision import assemble_batch

    L = max(r.stop - r.start for r in rows)

    def take(x):
        out = torch.zeros((len(rows), L, *x.shape[2:]), dtype=x.dtype)
        for i, r in enumerate(rows):
            out[i, : r.stop - r.start] = x[0, r]
        return out

    mask = take(torch.ones_like(u["loss"]))
    packed = None if seq_lens is None else torch.tensor(seq_lens)
    return assemble_batch(
        take(u["aux"]),
        take(u["ids"]),
        mask,
        take(u["loss"]),
        take(u["p"]),
        take(u["mass"]),
        take(u["argmax"]),
        u["t2d"],
        None if packed is None else packed_positions(packed, L),
        packed,
    )


@pytest.mark.parametrize("masks", ["text", "chat"])
def test_a_packed_row_trains_on_what_its_documents_do_alone(masks):
    """Assembled from unshifted rows as every backend does: the packed row's loss, metrics and
    supervised slots per TTT step equal those of its documents run as rows of their own. The last token
    of a document predicts nothing (text records used to be scored there on the next document's first
    token)."""
    draft = tiny_draft()
    u = unshifted_documents(draft.config, masks)
    starts = [0, 4, 10]
    packed = assembled(u, [slice(0, sum(DOCS))], [DOCS])
    alone = assembled(u, [slice(s, s + n) for s, n in zip(starts, DOCS)])
    a, b = ttt_forward(draft, packed, ttt_steps=3), ttt_forward(draft, alone, ttt_steps=3)
    assert a.supervised.tolist() == b.supervised.tolist() and a.total.tolist() == b.total.tolist()
    assert a.correct.tolist() == b.correct.tolist()
    torch.testing.assert_close(a.step_loss, b.step_loss)
    # slots scored at step k: each document's tokens with a target k + 1 tokens ahead in that document
    loss = u["loss"][0]
    expected = [
        sum(int(loss[s + 1 + k : s + n].sum()) for s, n in zip(starts, DOCS)) for k in range(3)
    ]
    assert a.total.tolist() == expected  # text: [12, 9, 6], chat: [9, 9, 6]
    assert doc_remaining(packed.attention_mask, packed.seq_lens).tolist() == [
        [4, 3, 2, 1, 6, 5, 4, 3, 2, 1, 5, 4, 3, 2, 1]
    ]


def test_rolling_never_reads_past_the_real_length():
    draft = tiny_draft()
    batch = random_batch(draft.config, [6, 10], 10)
    batch.loss_mask[:] = 1  # even if padding were marked, it must not be supervised
    batch.position_mask[:] = True
    out = ttt_forward(draft, batch, ttt_steps=2)
    assert out.supervised.tolist() == [16, 14]


def test_step_without_supervision_gives_zero_and_finite_gradients():
    draft = tiny_draft()
    batch = random_batch(draft.config, [5, 5], 5)
    batch.loss_mask[:] = 0
    batch.loss_mask[:, 0] = 1
    batch.position_mask = batch.loss_mask.bool()
    out = ttt_forward(draft, batch, ttt_steps=3, loss="lk-lambda")
    assert out.supervised.tolist() == [2, 0, 0]
    assert out.step_loss[1:].tolist() == [0.0, 0.0]
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for _, p in _trainable(draft))


def test_metrics_and_acceptance_length():
    draft = tiny_draft()
    batch = random_batch(draft.config, [13, 9], 13)
    out = ttt_forward(draft, batch, ttt_steps=3)
    acc = out.correct.double() / out.total.double()
    torch.testing.assert_close(out.accuracy, acc)
    torch.testing.assert_close(
        out.acceptance_length, 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    )
    assert float(acceptance_length(torch.tensor([1.0, 1.0, 0.5]))) == 3.5


def test_packed_positions_default_to_restarting_per_document():
    draft = tiny_draft()
    batch = random_batch(draft.config, [14, 12], 14, [[5, 9], [4, 3, 5]])
    assert torch.equal(packed_positions(batch.seq_lens, 14)[:, :12], batch.position_ids[:, :12])
    expected = ttt_forward(draft, batch, ttt_steps=2).loss
    batch.position_ids = None
    torch.testing.assert_close(ttt_forward(draft, batch, ttt_steps=2).loss, expected)


def test_shift_left():
    x = torch.arange(10).view(2, 5)
    assert shift_left(x, 2).tolist() == [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]]


def test_left_padding_is_rejected():
    draft = tiny_draft()
    batch = random_batch(draft.config, [5, 5], 5)
    batch.attention_mask[0] = torch.tensor([0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="right-padded"):
        ttt_forward(draft, batch, ttt_steps=1)
