"""The EAGLE-3 draft module: engine-loadable names, vocab map, embeddings, incremental decoding."""

import json

import pytest
import torch

from spec_cli.draft.attention import Segments
from spec_cli.draft.config import DraftConfig
from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.draft.layers import KVCache, feature_noise
from spec_cli.errors import ConfigError, TargetError
from tests.draft import (
    VD,
    V,
    one_thread,  # noqa: F401 (autouse fixture)
    random_batch,
    selected_ids,
    tiny_config,
    tiny_draft,
)

LAYER = [
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def test_state_dict_has_engine_names_and_shapes():
    draft = Eagle3Draft(tiny_config())
    sd = draft.state_dict()
    expected = {
        "embed_tokens.weight",
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        *(f"midlayer.{n}" for n in LAYER),
    }
    assert set(sd) == expected
    H, Ht, d = 32, 12, 8
    assert sd["embed_tokens.weight"].shape == (V, H)
    assert sd["fc.weight"].shape == (H, 3 * Ht)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * d, 2 * H)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * d, 2 * H)
    assert sd["lm_head.weight"].shape == (VD, H)
    assert sd["d2t"].dtype == torch.long and sd["d2t"].shape == (VD,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (V,)
    assert not draft.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for n, p in draft.named_parameters() if n != "embed_tokens.weight")


def test_eagle31_and_extra_layer_names():
    sd = Eagle3Draft(tiny_config(fc_norm=True, num_hidden_layers=3)).state_dict()
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(sd)
    assert sd["fc_norm.0.weight"].shape == (12,)
    for i in (1, 2):  # ordinary Llama layers: H input, no hidden_norm
        assert sd[f"layers.{i}.self_attn.q_proj.weight"].shape == (32, 32)
        assert f"layers.{i}.hidden_norm.weight" not in sd
        assert f"layers.{i}.mlp.down_proj.weight" in sd
    assert not any(k.startswith("layers.0.") for k in sd)


def test_set_vocab_map_writes_offsets_and_mask():
    draft = Eagle3Draft(tiny_config())
    assert not draft.has_vocab_map
    sel = selected_ids()
    draft.set_vocab_map(sel)
    assert draft.has_vocab_map
    assert torch.equal(torch.arange(VD) + draft.d2t, sel)  # target_id = draft_id + d2t[draft_id]
    assert torch.equal(draft.t2d.nonzero().flatten(), sel)
    assert torch.equal(draft.to_target_ids(torch.arange(VD)), sel)
    with pytest.raises(ConfigError):
        draft.set_vocab_map(sel[:-1])
    with pytest.raises(ConfigError):
        draft.set_vocab_map(sel.flip(0))
    # the map survives a state_dict round trip
    other = Eagle3Draft(tiny_config())
    other.load_state_dict(draft.state_dict())
    assert torch.equal(other.d2t, draft.d2t) and torch.equal(other.t2d, draft.t2d)


def test_copy_embeddings():
    draft = Eagle3Draft(tiny_config())
    weight = torch.randn(V, 32)
    draft.copy_embeddings(weight)
    assert torch.equal(draft.embed_tokens.weight, weight)
    assert not draft.embed_tokens.weight.requires_grad
    with pytest.raises(ConfigError):
        draft.copy_embeddings(torch.randn(V, 16))


def test_project_and_logits_shapes():
    draft = tiny_draft(fc_norm=True)
    aux = torch.randn(2, 5, 36)
    assert draft.project(aux).shape == (2, 5, 32)
    hidden = torch.randn(2, 5, 32)
    assert draft.logits(hidden).shape == (2, 5, VD)
    torch.testing.assert_close(draft.logits(hidden), draft.lm_head(draft.norm(hidden)))
    normed = tiny_draft(norm_output=True)
    torch.testing.assert_close(
        normed.logits(hidden), normed.lm_head(hidden)
    )  # norm already applied


@pytest.mark.parametrize(
    "options", [dict(), dict(num_hidden_layers=2, norm_output=True, fc_norm=True)]
)
def test_incremental_decoding_matches_full_forward(options):
    draft = tiny_draft(dtype=torch.float64, **options)
    batch = random_batch(draft.config, [11, 11], 11, dtype=torch.float64)
    with torch.no_grad():
        full = draft(batch.input_ids, batch.aux_hidden)  # [B, T, H] step 0, causal
        hidden = draft.project(batch.aux_hidden)
        pos = torch.arange(11).expand(2, 11)
        cache = KVCache(options.get("num_hidden_layers", 1))
        pieces = []
        for start, end in [(0, 4), (4, 5), (5, 6), (6, 11)]:  # a prefill, then single tokens
            pieces.append(
                draft.forward_step(
                    batch.input_ids[:, start:end], hidden[:, start:end], pos[:, start:end], cache
                )
            )
            assert len(cache) == end
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-12, rtol=1e-10)

        # drop speculative positions and redo them: same result
        cache.crop(6)
        again = draft.forward_step(batch.input_ids[:, 6:], hidden[:, 6:], pos[:, 6:], cache)
        torch.testing.assert_close(again, full[:, 6:], atol=1e-12, rtol=1e-10)


def test_ttt_step_one_equals_decoding_with_an_extra_key():
    """At TTT step 1, slot t sees the step-0 keys of 0..t plus its own step-1 key at position t + 1:
    exactly serving's decode of the first drafted token, one position on, whose cache holds the
    step-0 keys of 0..t (spec eval and vLLM both feed draft token j at position t + j)."""
    draft = tiny_draft(dtype=torch.float64)
    batch = random_batch(draft.config, [7], 7, dtype=torch.float64)
    B, T = 1, 7
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        cos, sin = draft.rope(pos)
        caches = [[]]
        h0 = draft.ttt_step(batch.input_ids, draft.project(batch.aux_hidden), cos, sin, caches)
        ids1 = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1] * 0], 1)
        h1 = draft.ttt_step(ids1, h0, *draft.rope(pos + 1), caches)
        hidden = draft.project(batch.aux_hidden)
        for t in range(T):
            cache = KVCache(1)
            draft.forward_step(
                batch.input_ids[:, : t + 1], hidden[:, : t + 1], pos[:, : t + 1], cache
            )
            step = draft.forward_step(
                ids1[:, t : t + 1], h0[:, t : t + 1], pos[:, t : t + 1] + 1, cache
            )
            torch.testing.assert_close(step[:, 0], h1[:, t], atol=1e-12, rtol=1e-10)


def test_hidden_noise_only_in_training_and_relative_to_each_aux_state():
    """--hidden-noise perturbs the aux states the draft reads in training; evaluation (eval mode: the
    trainer's held-out split, spec eval, export's self-check) reads them clean."""
    draft = tiny_draft(fc_norm=True)
    aux = torch.randn(2, 5, 36)
    clean = draft.project(aux)
    draft.hidden_noise = 0.05
    torch.manual_seed(1)
    noisy = draft.project(aux)
    assert not torch.allclose(noisy, clean)
    torch.manual_seed(1)
    expected = draft.fc(
        torch.cat(
            [norm(c) for norm, c in zip(draft.fc_norm, feature_noise(aux, 0.05, 3).chunk(3, -1))],
            -1,
        )
    )
    torch.testing.assert_close(noisy, expected)
    draft.eval()
    assert torch.equal(draft.project(aux), clean)
    assert "noise" not in json.dumps(draft.config.to_dict())  # the engine's config never carries it


@pytest.mark.parametrize("layers,window,packed", [(1, 4, False), (2, 3, False), (1, 4, True)])
def test_sliding_window_ttt_equals_windowed_decoding(layers, window, packed):
    """--draft-window: every TTT step's state at every slot equals what decoding computes for that
    draft token under the engine's rule (a query at position p attends cached keys at positions
    > p - W): decode a document's slots 0..t, then feed the TTT step's token and state one position on
    per step. The training side sees W - k step-0 keys at step k; a window by slots (W at every step)
    fails this test at step 1 and later."""
    draft = tiny_draft(dtype=torch.float64, num_hidden_layers=layers, sliding_window=window)
    T, K = 11, 3
    docs = [[5, 6]] if packed else None
    batch = random_batch(draft.config, [T], T, seq_lens=docs, dtype=torch.float64)
    spans = [(0, 5), (5, 11)] if packed else [(0, T)]
    bias = Segments.from_lengths(docs, T) if packed else None
    pos = torch.cat([torch.arange(e - s) for s, e in spans])[None]
    with torch.no_grad():
        caches = [[] for _ in range(layers)]
        ids, states = batch.input_ids, []
        state = draft.project(batch.aux_hidden)
        for k in range(K):
            state = draft.ttt_step(
                torch.roll(ids, -k, dims=1), state, *draft.rope(pos + k), caches, bias
            )
            states.append(state)
        hidden = draft.project(batch.aux_hidden)
        checked = 0
        for s, e in spans:
            for t in range(s, e - K + 1):  # slots whose K draft tokens stay in their document
                cache = KVCache(layers)
                draft.forward_step(
                    ids[:, s : t + 1], hidden[:, s : t + 1], pos[:, s : t + 1], cache
                )
                for k in range(1, K):
                    step = draft.forward_step(
                        ids[:, t + k : t + k + 1],
                        states[k - 1][:, t : t + 1],
                        pos[:, t : t + 1] + k,
                        cache,
                    )
                    torch.testing.assert_close(step[:, 0], states[k][:, t], atol=1e-12, rtol=1e-10)
                    checked += 1
        assert checked >= 2 * (T - 2 * K)
        # and the window matters here: without it the states differ
        plain = tiny_draft(dtype=torch.float64, num_hidden_layers=layers)
        caches = [[] for _ in range(layers)]
        last = plain.project(batch.aux_hidden)
        for k in range(K):
            last = plain.ttt_step(
                torch.roll(ids, -k, dims=1), last, *plain.rope(pos + k), caches, bias
            )
        assert not torch.allclose(last, states[-1])


def test_sliding_window_must_be_positive():
    with pytest.raises(ConfigError, match="sliding window"):
        tiny_config(sliding_window=0)


def test_context_parallel_ranks_draw_their_own_noise():
    """--hidden-noise under --context-parallel: the group's ranks share the global RNG's state, so each draws
    from a generator seeded by one draw of it plus its place in the group: different noise on each rank's
    slots, the same again from the same state (a resume), and the global RNG advances alike on every rank."""
    x = torch.ones(2, 5, 12)
    draws = {}
    for offset in (0, 1, 0):
        torch.manual_seed(3)
        noisy = feature_noise(x, 0.1, 3, offset=offset)
        draws.setdefault(offset, []).append(noisy)
        after = torch.rand(1)
    torch.manual_seed(3)
    feature_noise(x, 0.1, 3, offset=5)
    assert torch.equal(torch.rand(1), after)  # one draw of the global RNG whatever the offset
    assert torch.equal(draws[0][0], draws[0][1]) and not torch.allclose(draws[0][0], draws[1][0])


def test_a_draft_started_from_a_target_layer_computes_that_layer(tiny_llama_dir):
    """--init-layer-from-target: with the token's half of q/k/v silenced, the started draft's state is
    the target's layer L applied to its aux state L-1 (transformers' own forward, 8-layer tiny Llama)."""
    from transformers import AutoModelForCausalLM

    from spec_cli.targets import loading

    target = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).float().eval()
    aux = [0, 1, 4]
    config = DraftConfig.from_target(target.config, 64, aux)
    draft = Eagle3Draft(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = target(
            input_ids=ids, output_hidden_states=True
        ).hidden_states  # [i]: layer i-1's output
        draft.init_layer_from_target(loading.read_decoder_layer(tiny_llama_dir, 5), aux_index=2)
        H = config.hidden_size
        for proj in (
            draft.midlayer.self_attn.q_proj,
            draft.midlayer.self_attn.k_proj,
            draft.midlayer.self_attn.v_proj,
        ):
            proj.weight[:, :H] = 0  # the token's half: random at the start, silenced here
        got = draft(ids, torch.cat([states[i + 1] for i in aux], dim=-1))
    torch.testing.assert_close(got, states[6], rtol=1e-4, atol=1e-4)


def test_a_target_layer_that_does_not_fit_is_one_error(tiny_llama_dir):
    from spec_cli.targets import loading

    config = DraftConfig.from_target(
        loading.load_config(tiny_llama_dir), 64, [0, 1, 4], intermediate_size=48
    )
    with pytest.raises(ConfigError, match="mlp.gate_proj.weight .* against"):
        Eagle3Draft(config).init_layer_from_target(loading.read_decoder_layer(tiny_llama_dir, 5), 2)
    with pytest.raises(TargetError, match="do not hold layer 8's"):
        loading.read_decoder_layer(tiny_llama_dir, 8)
