"""The EAGLE-1/2 draft against a plain-torch reference of what vLLM's EagleLlamaForCausalLM and
SGLang's LlamaForCausalLMEagle compute (cat(embed(x[t+1]), f[t]) -> fc -> Llama layers with no input
norm on layer 0 -> no final norm -> the target's lm_head), its engine parameter names, incremental
decoding, and the refusals a user can hit."""

import math

import pytest
import torch
import torch.nn.functional as F

from spec_cli.draft.config import DraftConfig
from spec_cli.draft.decoding import catch_up
from spec_cli.draft.eagle.model import EagleDraft
from spec_cli.errors import ConfigError
from tests.draft import one_thread  # noqa: F401 (autouse fixture)

V, H = 40, 16


def eagle_config(**overrides) -> DraftConfig:
    values = dict(
        vocab_size=V,
        target_hidden_size=H,
        aux_layer_ids=[],
        target_num_layers=6,
        hidden_size=H,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        draft_vocab_size=V,
        rope_theta=1000.0,
        algorithm="eagle",
    )
    values.update(overrides)
    return DraftConfig(**values)


def eagle_draft(seed: int = 0, **overrides) -> EagleDraft:
    torch.manual_seed(seed)
    draft = EagleDraft(eagle_config(**overrides))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        draft.embed_tokens.weight.normal_()
        draft.lm_head.weight.normal_()
    return draft


def reference(
    W: dict, c: DraftConfig, ids: torch.Tensor, feats: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] ids, [T, H] features at positions 0..T-1 -> (states [T, H], logits [T, V]), causal."""
    nh, nkv, hd, T = c.num_attention_heads, c.num_key_value_heads, c.head_dim, ids.numel()

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    def rope(x):
        inv = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.arange(T).float()[:, None] * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    x = torch.cat([W["embed_tokens.weight"][ids], feats], -1) @ W["fc.weight"].T
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        h = x if i == 0 else rms(x, W[p + "input_layernorm.weight"])
        q = rope((h @ W[p + "self_attn.q_proj.weight"].T).view(T, nh, hd))
        k = rope((h @ W[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd)).repeat_interleave(
            nh // nkv, 1
        )
        v = (
            (h @ W[p + "self_attn.v_proj.weight"].T)
            .view(T, nkv, hd)
            .repeat_interleave(nh // nkv, 1)
        )
        att = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask).softmax(-1)
        x = (
            x
            + torch.einsum("hqk,khd->qhd", att, v).reshape(T, nh * hd)
            @ W[p + "self_attn.o_proj.weight"].T
        )
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        x = (
            x
            + (F.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T))
            @ W[p + "mlp.down_proj.weight"].T
        )
    return x, x @ W["lm_head.weight"].T


def test_parameters_are_the_engines_names_with_no_layer0_input_norm_and_no_final_norm():
    draft = eagle_draft(num_hidden_layers=2)
    shapes = {k: tuple(v.shape) for k, v in draft.state_dict().items()}
    layer = {
        "self_attn.q_proj.weight": (16, H),
        "self_attn.k_proj.weight": (8, H),
        "self_attn.v_proj.weight": (8, H),
        "self_attn.o_proj.weight": (H, 16),
        "mlp.gate_proj.weight": (24, H),
        "mlp.up_proj.weight": (24, H),
        "mlp.down_proj.weight": (H, 24),
        "post_attention_layernorm.weight": (H,),
    }
    expected = {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, 2 * H),
        "lm_head.weight": (V, H),
        **{f"layers.0.{k}": s for k, s in layer.items()},
        **{f"layers.1.{k}": s for k, s in layer.items()},
        "layers.1.input_layernorm.weight": (H,),
    }
    assert shapes == expected
    trained = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert trained == set(expected) - {
        "embed_tokens.weight",
        "lm_head.weight",
    }  # both are the target's


@pytest.mark.parametrize("layers", [1, 2])
def test_a_forward_is_the_engines_computation(layers):
    draft = eagle_draft(num_hidden_layers=layers).eval()
    W = {k: v.detach() for k, v in draft.state_dict().items()}
    T = 9
    ids, feats = torch.randint(0, V, (T,)), torch.randn(T, H)
    with torch.no_grad():
        state = draft(ids[None], feats[None])[0]
    want_state, want_logits = reference(W, draft.config, ids, feats)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(draft.logits(state), want_logits, rtol=1e-5, atol=1e-5)


def test_decoding_slot_by_slot_equals_the_full_forward():
    draft = eagle_draft(num_hidden_layers=2).eval()
    T = 8
    ids, feats = torch.randint(0, V, (T,)), torch.randn(T, H)
    with torch.no_grad():
        full = draft(ids[None], feats[None])[0]
        cache = draft.new_cache()
        first = catch_up(draft, cache, ids[:5], feats[:5])  # the last slot's state
        rest = catch_up(draft, cache, ids[5:], feats[5:])
    torch.testing.assert_close(first[0, 0], full[4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest[0, 0], full[-1], rtol=1e-5, atol=1e-5)
    assert torch.equal(draft.to_target_ids(torch.tensor([3, 7])), torch.tensor([3, 7]))


def test_what_an_eagle_draft_cannot_be_is_one_error_naming_the_fix():
    with pytest.raises(ConfigError, match="whole vocabulary") as err:
        EagleDraft(eagle_config(draft_vocab_size=24))
    assert f"--draft-vocab-size {V}" in err.value.hint
    with pytest.raises(ConfigError, match="hidden size 32 must be the same"):
        EagleDraft(eagle_config(hidden_size=32))
    with pytest.raises(ConfigError, match="EAGLE-3.1 options"):
        EagleDraft(eagle_config(fc_norm=True))
    draft = eagle_draft()
    draft.set_vocab_map(torch.arange(V))  # the whole vocabulary in order: fine
    with pytest.raises(ConfigError, match="selects a subset"):
        draft.set_vocab_map(torch.arange(V - 1))


def test_hidden_noise_reaches_the_input_state_only_and_only_in_training():
    """EAGLE-1/2 reads the target's final states as its input and regresses onto the same states: the
    noise goes on the input copy, never on the features the loss compares with."""
    draft = eagle_draft()
    features = torch.randn(2, 5, H)
    kept = features.clone()
    draft.hidden_noise = 0.1
    noisy = draft.project(features)
    assert torch.equal(features, kept)  # the loss's targets untouched
    ratio = (noisy - features) / features.pow(2).mean(-1, keepdim=True).sqrt()
    assert 0.05 < ratio.std().item() < 0.15
    draft.eval()
    assert torch.equal(draft.project(features), features)
