"""Packed supervision equals each document's own forward, for every attention layer kind a target
declares: full (Llama), sliding (Mistral: every layer), sliding + full (Gemma 3), chunked + full
(Llama 4, at the mask level); documents run past every window. Targets whose layers keep a state over
the whole row (Qwen3-Next's linear attention) are refused, in process and over the server."""

import pytest
import torch

from spec_cli.errors import ConfigError
from spec_cli.serve.client import RemoteBackend, RemoteError
from spec_cli.targets.hf_backend import HFTargetBackend
from spec_cli.targets.masks import Layout, document_ids, for_model
from tests import windowed
from tests.serve.harness import start_server

pytestmark = pytest.mark.usefixtures("one_thread")

# two rows: documents longer than the window (8), short ones, and padding at the end of each row
SEQ_LENS = torch.tensor([[21, 5, 17], [30, 12, 0]])
T = 47


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma3"])
def target_dir(request, tmp_path_factory):
    return windowed.save_target(
        tmp_path_factory.mktemp(request.param) / "target",
        request.param,
        tied=request.param == "gemma3",
    )


@pytest.fixture(scope="module")
def backend(target_dir):
    b = HFTargetBackend(target_dir, windowed.AUX, device="cpu", dtype="fp32")
    b.set_vocab_mapping(
        torch.sort(
            torch.randperm(b.info["vocab_size"], generator=torch.Generator().manual_seed(0))[:64]
        ).values
    )
    yield b
    b.close()


def packed_batch(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (2, T), generator=gen)
    am = (torch.arange(T)[None] < SEQ_LENS.sum(1, keepdim=True)).long()
    lm = (torch.rand(2, T, generator=gen) < 0.7).long() * am
    return ids, am, lm


def documents():
    """(row, start, length) of every document."""
    for b in range(SEQ_LENS.shape[0]):
        start = 0
        for n in SEQ_LENS[b].tolist():
            if n:
                yield b, start, n
            start += n


def test_packed_supervision_equals_each_documents_own_forward(backend):
    model = backend.model
    ids, am, lm = packed_batch(backend.info["vocab_size"])
    for b, start, _ in documents():
        lm[b, start] = 1  # a document whose first token carries loss (a text record)
    batch = backend.generate_batch(ids, am, lm, seq_lens=SEQ_LENS)
    sel, H = backend.selected, backend.info["hidden_size"]
    agree = total = 0
    for b, start, n in documents():
        doc = ids[b : b + 1, start : start + n]
        with (
            torch.no_grad()
        ):  # the independent reference: the document alone, the model's own masks
            out = model(input_ids=doc, output_hidden_states=True)
        logits = out.logits[0].float()  # [n, V]
        span = slice(start, start + n - 1)  # position t is supervised by the target's output at t+1
        torch.testing.assert_close(
            batch.target_p[b, span], torch.softmax(logits[1:, sel], -1), rtol=1e-4, atol=1e-6
        )
        torch.testing.assert_close(
            batch.target_mass[b, span],
            torch.softmax(logits[1:], -1)[:, sel].sum(-1),
            rtol=1e-4,
            atol=1e-6,
        )
        top = logits[1:].argmax(-1)
        agree += int((batch.target_ids[b, span] == top).sum())
        total += n - 1
        assert torch.equal(
            batch.position_mask[b, span], backend.t2d[top] & lm[b, start + 1 : start + n].bool()
        )
        assert torch.equal(batch.input_ids[b, span], doc[0, 1:])
        assert torch.equal(batch.loss_mask[b, span], lm[b, start + 1 : start + n])
        last = start + n - 1  # predicts nothing: the next token starts another document
        assert batch.loss_mask[b, last] == 0 and not batch.position_mask[b, last]
        assert float(batch.target_p[b, last].abs().sum()) == 0.0 and batch.target_ids[b, last] == 0
        for k, layer in enumerate(windowed.AUX):  # outputs of the aux layers, position-aligned
            torch.testing.assert_close(
                batch.aux_hidden[b, start : start + n, k * H : (k + 1) * H],
                out.hidden_states[layer + 1][0],
                rtol=1e-4,
                atol=1e-5,
            )
    assert (
        agree == total
    )  # argmax agreement 100% (the sliding layers' window honoured per document)


def test_a_mask_without_the_window_would_not_pass(backend):
    """The test above has teeth on the windowed targets: block-causal masks on every layer (what packing
    did before) give different hidden states past the window."""
    if backend.layout.kinds == ["full_attention"]:
        pytest.skip("a full-attention target has no window to miss")
    ids, am, _ = packed_batch(backend.info["vocab_size"])
    masks, positions = Layout(("full_attention",)).packed(SEQ_LENS, T)
    with torch.no_grad():
        blind = backend.decoder(
            input_ids=ids, attention_mask=masks["full_attention"], position_ids=positions
        ).last_hidden_state
    _, exact = backend.run_target(ids, am, seq_lens=SEQ_LENS)
    b, start, n = next(documents())  # 21 tokens, window 8
    assert torch.allclose(
        blind[b, start : start + windowed.WINDOW],
        exact[b, start : start + windowed.WINDOW],
        atol=1e-5,
    )  # within the window the two agree
    assert not torch.allclose(
        blind[b, start + windowed.WINDOW : start + n],
        exact[b, start + windowed.WINDOW : start + n],
        atol=1e-3,
    )


def test_chunked_attention_masks_equal_each_documents_own_forward():
    """Llama 4 text layers: chunked (chunks restart per document) and full; at the decoder level."""
    model = windowed.model("llama4")
    layout = Layout.from_config(model.config)
    assert (
        layout.kinds == ["chunked_attention", "full_attention"]
        and layout.chunk_size == windowed.WINDOW
    )
    ids, _, _ = packed_batch(256, seed=1)
    masks, positions = layout.packed(SEQ_LENS, T)
    with torch.no_grad():
        packed = model.model(
            input_ids=ids,
            attention_mask=for_model(masks, "sdpa", torch.float32, "packing"),
            position_ids=positions,
        ).last_hidden_state
        for b, start, n in documents():
            alone = model.model(input_ids=ids[b : b + 1, start : start + n]).last_hidden_state[0]
            torch.testing.assert_close(packed[b, start : start + n], alone, rtol=1e-4, atol=1e-5)


def test_layer_kinds_are_read_as_transformers_reads_them():
    import transformers

    assert (
        Layout.from_config(windowed.config("mistral", 64)).layer_types == ("sliding_attention",) * 6
    )
    assert Layout.from_config(windowed.config("llama", 64)).kinds == ["full_attention"]
    gemma = Layout.from_config(windowed.config("gemma3", 64))
    assert (
        gemma.kinds == ["sliding_attention", "full_attention"]
        and gemma.sliding_window == windowed.WINDOW
    )
    qwen2 = transformers.Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2
    )
    assert (
        Layout.from_config(qwen2).layer_types
        == ("full_attention",) * 2 + ("sliding_attention",) * 2
    )
    # nested text config (Gemma 3 multimodal)
    nested = transformers.Gemma3Config(text_config=windowed.config("gemma3", 64).to_dict())
    assert Layout.from_config(nested).kinds == gemma.kinds


def test_document_ids_and_positions():
    docs, positions = document_ids(torch.tensor([[3, 2, 0]]), 7)
    assert docs.tolist() == [[0, 0, 0, 1, 1, -1, -2]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0]]
    masks, _ = Layout(("sliding_attention",), sliding_window=2).packed(torch.tensor([[4]]), 5)
    assert masks["sliding_attention"][0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]  # padding: itself only


@pytest.fixture(scope="module")
def linear_target(tmp_path_factory):
    return windowed.save_target(tmp_path_factory.mktemp("qwen3next") / "target", "qwen3next")


def test_a_target_with_linear_attention_is_refused_for_packing(linear_target):
    backend = HFTargetBackend(linear_target, windowed.AUX, device="cpu", dtype="fp32")
    handle = start_server(backend, linear_target)
    try:
        backend.set_vocab_mapping(torch.arange(64))
        ids, am, lm = packed_batch(backend.info["vocab_size"])
        with pytest.raises(ConfigError, match="linear_attention layers keep a state") as err:
            backend.generate_batch(ids, am, lm, seq_lens=SEQ_LENS)
        assert "--pack" in err.value.message and "without --pack" in err.value.hint
        one = backend.generate_batch(ids[:1, :21], am[:1, :21], lm[:1, :21])  # unpacked: served
        assert one.target_p.shape[:2] == (1, 21)

        remote = RemoteBackend(
            [handle.url]
        )  # the server refuses it the same way (422, with the hint)
        remote.set_vocab_mapping(torch.arange(64))
        with pytest.raises(
            RemoteError, match="answered 422 to .*linear_attention layers keep a state"
        ) as err:
            remote.generate_batch(ids, am, lm, seq_lens=SEQ_LENS)
        assert err.value.hint == "train without --pack (one document per row)"
        remote.close()
    finally:
        handle.stop(grace=5)
        backend.close()


def test_a_packed_request_to_a_server_equals_the_in_process_batch(backend, target_dir):
    ids, am, lm = packed_batch(backend.info["vocab_size"], seed=2)
    handle = start_server(backend, target_dir)
    try:
        remote = RemoteBackend([handle.url])
        remote.set_vocab_mapping(backend.selected.clone())
        got = remote.generate_batch(ids, am, lm, seq_lens=SEQ_LENS).tensors()
        remote.close()
    finally:
        handle.stop(grace=5)
    for name, t in backend.generate_batch(ids, am, lm, seq_lens=SEQ_LENS).tensors().items():
        assert torch.equal(got[name], t), name


def test_one_packed_row_as_positions_alone_is_the_masks_forward(backend):
    """A packed row given as positions alone (restarting at 0 per document, no mask) is read by
    transformers as its documents: the same hidden states as the per-kind masks, full and sliding
    layers alike. It is how a flash-attention target gets packed rows (one varlen call per layer,
    its offsets derived from the same positions: next test), checked here on sdpa."""
    ids, am, _ = packed_batch(backend.info["vocab_size"])
    row = slice(0, 1)
    _, with_masks = backend.run_target(ids[row], am[row], seq_lens=SEQ_LENS[row])
    _, positions = document_ids(SEQ_LENS[row], T)
    with torch.no_grad():
        alone = backend.decoder(
            input_ids=ids[row], attention_mask=None, position_ids=positions, use_cache=False
        ).last_hidden_state
    torch.testing.assert_close(alone, with_masks, rtol=1e-4, atol=1e-5)


def test_flash_attention_targets_take_packed_rows_as_offsets_and_positions(backend, monkeypatch):
    """A target loaded with flash attention (which takes no custom mask) gets each packed row as its
    documents' offsets (each padding token its own), positions restarting per document and no mask,
    one row per forward; transformers' flash path reads the same offsets from those positions. The
    rows' outputs, run here through sdpa (flash needs a GPU), are the per-kind masks' for both rows."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    ids, am, _ = packed_batch(backend.info["vocab_size"])
    aux_masks, last_masks = backend.run_target(ids, am, seq_lens=SEQ_LENS)
    real, seen = backend.decoder, []

    def decoder(**kwargs):
        seen.append(dict(kwargs))
        flash = {
            k: kwargs.pop(k)
            for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
        }
        assert flash["cu_seq_lens_q"].dtype == torch.int32 and isinstance(
            flash["max_length_q"], int
        )
        backend.model.config._attn_implementation = "sdpa"
        try:
            return real(**kwargs)
        finally:
            backend.model.config._attn_implementation = "flash_attention_2"

    monkeypatch.setattr(backend.model.config, "_attn_implementation", "flash_attention_2")
    monkeypatch.setattr(backend, "decoder", decoder)
    aux, last = backend.run_target(ids, am, seq_lens=SEQ_LENS)
    assert len(seen) == 2 and all(
        k["attention_mask"] is None and k["input_ids"].shape[0] == 1 for k in seen
    )
    assert (
        seen[0]["cu_seq_lens_q"].tolist() == [0, 21, 26, 43, *range(44, T + 1)]
        and seen[0]["max_length_q"] == 21
    )
    assert (
        seen[1]["cu_seq_lens_q"].tolist() == [0, 30, 42, *range(43, T + 1)]
        and seen[1]["max_length_q"] == 30
    )
    for k in seen:  # transformers' own reading of the positions gives the same offsets
        (cu, _), (longest, _) = prepare_fa_kwargs_from_position_ids(k["position_ids"])
        assert cu.tolist() == k["cu_seq_lens_q"].tolist() and int(longest) == k["max_length_q"]
    torch.testing.assert_close(last, last_masks, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(aux, aux_masks, rtol=1e-4, atol=1e-5)


def test_flash_attention_is_asked_for_only_where_packed_rows_can_use_it():
    """Chunked attention (Llama 4) counts its chunks from the row's start under flash attention's
    offsets: such a target keeps sdpa and the masks (`packs_by_positions` is False)."""
    assert Layout(("full_attention", "sliding_attention"), sliding_window=8).packs_by_positions()
    assert not Layout(("chunked_attention", "full_attention"), chunk_size=8).packs_by_positions()
