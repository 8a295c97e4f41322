"""The live backend's supervision against an independent computation from the full logits."""

import pytest
import torch

from spec_cli.targets.hf_backend import HFTargetBackend
from spec_cli.targets.supervision import full_vocab_stats


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    b = HFTargetBackend(tiny_llama_dir, device="cpu", dtype="fp32")
    gen = torch.Generator().manual_seed(0)
    b.set_vocab_mapping(torch.sort(torch.randperm(400, generator=gen)[:64]).values)
    yield b
    b.close()


def random_batch(B=3, T=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 400, (B, T), generator=gen)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 15:] = 0
    am[2, 9:] = 0
    lm = (torch.rand(B, T, generator=gen) < 0.6).long() * am
    return ids, am, lm


def test_supervision_matches_full_logits(backend):
    ids, am, lm = random_batch()
    batch = backend.generate_batch(ids, am, lm)
    with torch.no_grad():
        out = backend.model(input_ids=ids, attention_mask=am, output_hidden_states=True)
    logits = out.logits.float()  # [B, T, V]: the independent reference
    sel = backend.selected
    t2d = torch.zeros(400, dtype=torch.bool)
    t2d[sel] = True
    for b in range(3):
        n = int(am[b].sum())
        for t in range(n - 1):  # position t is supervised by the target's output at t+1
            ref_p = torch.softmax(logits[b, t + 1, sel], -1)
            torch.testing.assert_close(batch.target_p[b, t], ref_p, rtol=1e-5, atol=1e-6)
            full = torch.softmax(logits[b, t + 1], -1)
            torch.testing.assert_close(
                batch.target_mass[b, t], full[sel].sum(), rtol=1e-5, atol=1e-6
            )
            top = int(logits[b, t + 1].argmax())
            assert int(batch.target_ids[b, t]) == top
            assert bool(batch.position_mask[b, t]) == (bool(t2d[top]) and bool(lm[b, t + 1]))
            assert int(batch.input_ids[b, t]) == int(ids[b, t + 1])
            assert int(batch.loss_mask[b, t]) == int(lm[b, t + 1])
        # the last real position and the padding carry nothing
        assert not batch.loss_mask[b, n - 1 :].any() and not batch.target_p[b, n - 1 :].any()
        # aux states are position-aligned outputs of layers 1, 3, 4 (N = 8)
        H = 32
        for k, layer in enumerate([1, 3, 4]):
            torch.testing.assert_close(
                batch.aux_hidden[b, :n, k * H : (k + 1) * H], out.hidden_states[layer + 1][b, :n]
            )
        assert not batch.aux_hidden[b, n:].any()


def test_chunked_full_vocab_stats_equal_unchunked():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 7, 16, generator=gen)
    head = torch.randn(300, 16, generator=gen)
    argmax, lse = full_vocab_stats(hidden, head, chunk_bytes=4 * 300 * 3)  # 3 tokens per chunk
    logits = hidden @ head.T
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    assert torch.equal(argmax, logits.argmax(-1))


def test_packed_documents_do_not_leak(backend):
    gen = torch.Generator().manual_seed(2)
    doc_a, doc_b = (
        torch.randint(5, 400, (7,), generator=gen),
        torch.randint(5, 400, (9,), generator=gen),
    )
    packed = torch.cat([doc_a, doc_b]).unsqueeze(0)
    am = torch.ones_like(packed)
    seq_lens = torch.tensor([[7, 9]])
    aux_packed, hid_packed = backend.run_target(packed, am, seq_lens=seq_lens)
    for doc, start in ((doc_a, 0), (doc_b, 7)):
        aux, hid = backend.run_target(
            doc.unsqueeze(0), torch.ones(1, doc.numel(), dtype=torch.long)
        )
        torch.testing.assert_close(
            aux_packed[0, start : start + doc.numel()], aux[0], rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            hid_packed[0, start : start + doc.numel()], hid[0], rtol=1e-5, atol=1e-5
        )
    batch = backend.generate_batch(packed, am, am, seq_lens=seq_lens)
    assert torch.equal(batch.seq_lens, seq_lens)  # carried through unshifted
