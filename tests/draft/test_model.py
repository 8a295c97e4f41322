"""The draft module: engine-loadable names, vocab map, embeddings, rope, incremental decoding."""

import pytest
import torch

from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.draft.layers import KVCache, rope_inv_freq
from spec_cli.errors import ConfigError
from tests.draft import one_thread  # noqa: F401 (autouse fixture)
from tests.draft import V, VD, random_batch, selected_ids, tiny_config, tiny_draft

LAYER = ["input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
         "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def test_state_dict_has_engine_names_and_shapes():
    draft = Eagle3Draft(tiny_config())
    sd = draft.state_dict()
    expected = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                *(f"midlayer.{n}" for n in LAYER)}
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
    torch.testing.assert_close(normed.logits(hidden), normed.lm_head(hidden))  # norm already applied


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
                                     {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                                      "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5},
                                     {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                                      "attention_factor": 1.3, "truncate": False}])
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_config(head_dim=64, hidden_size=256, rope_theta=500000.0, rope_scaling=scaling)
    params = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=params,
                     max_position_embeddings=4096)
    kind = params["rope_type"]
    if kind == "default":
        expected, scale = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64), 1.0
    else:
        expected, scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg), expected.float())
    # yarn scales cos/sin (transformers' attention_scaling, vLLM's mscale); the others leave them
    draft = Eagle3Draft(cfg)
    pos = torch.arange(50).expand(1, 50)
    cos, sin = draft.rope(pos)
    freqs = pos[..., None].float() * expected.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    torch.testing.assert_close(cos, emb.cos() * scale)
    torch.testing.assert_close(sin, emb.sin() * scale)
    assert (scale != 1.0) == (kind == "yarn")


def test_unsupported_rope_is_a_clear_error():
    with pytest.raises(ConfigError, match="rope type 'longrope'") as caught:
        Eagle3Draft(tiny_config(rope_scaling={"rope_type": "longrope", "factor": 4.0}))
    assert "--draft-rope-theta" in caught.value.hint


@pytest.mark.parametrize("options", [dict(), dict(num_hidden_layers=2, norm_output=True, fc_norm=True)])
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
            pieces.append(draft.forward_step(batch.input_ids[:, start:end], hidden[:, start:end],
                                             pos[:, start:end], cache))
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
            draft.forward_step(batch.input_ids[:, :t + 1], hidden[:, :t + 1], pos[:, :t + 1], cache)
            step = draft.forward_step(ids1[:, t:t + 1], h0[:, t:t + 1], pos[:, t:t + 1] + 1, cache)
            torch.testing.assert_close(step[:, 0], h1[:, t], atol=1e-12, rtol=1e-10)
