"""The draft's rope comes from the target for every config layout transformers writes (flat
rope_parameters, 4.x rope_theta + rope_scaling, Gemma 3's per-layer-type nesting), and reaches the
exported config.json the engines read."""

import json
from types import SimpleNamespace

import pytest
import transformers

from spec_cli.draft.config import DraftConfig, target_rope
from spec_cli.errors import ConfigError
from spec_cli.stages import export as export_stage
from spec_cli.targets.loading import config_from_dict
from tests.export.drafts import make_run

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
)


def gemma3(**rope):
    return transformers.Gemma3TextConfig(
        **SMALL, sliding_window=16, max_position_embeddings=32768, **rope
    )


def draft_of(config, **overrides) -> DraftConfig:
    return DraftConfig.from_target(config, 40, [1, 2, 3], **overrides)


def test_gemma3_takes_the_full_attention_rope_and_says_so():
    c = draft_of(
        gemma3()
    )  # transformers 5 nests it: full_attention theta 1e6, sliding_attention 1e4
    assert c.rope_theta == 1_000_000.0 and c.rope_scaling is None
    assert "rope_parameters['full_attention']" in c.rope_source
    assert (
        "sliding_attention: theta 10000" in c.rope_source
        and "full-attention layer" in c.rope_source
    )


def test_gemma3_scaling_of_the_full_attention_layers_is_kept():
    # Gemma 3 4B+ scale their global layers: rope_scaling linear x8 lands in rope_parameters["full_attention"]
    config = gemma3(rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert config.rope_parameters["sliding_attention"] == {
        "rope_type": "default",
        "rope_theta": 10000.0,
    }
    c = draft_of(config)
    assert (c.rope_theta, c.rope_scaling) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})


def test_gemma3_saved_by_transformers_4_reads_the_same():
    # the 4.x spelling of the same model (as a cache manifest may hold it): rope_theta is the global theta,
    # rope_local_base_freq the sliding one, rope_scaling the global layers' scaling
    legacy = {
        "model_type": "gemma3_text",
        **SMALL,
        "sliding_window": 16,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"type": "linear", "factor": 8.0},
    }
    c = draft_of(config_from_dict(legacy))
    assert (c.rope_theta, c.rope_scaling) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})


def test_gemma3_multimodal_reads_its_text_config():
    config = transformers.Gemma3Config(
        text_config=gemma3(rope_scaling={"rope_type": "linear", "factor": 8.0}).to_dict()
    )
    c = draft_of(config)
    assert (c.rope_theta, c.rope_scaling["factor"]) == (1_000_000.0, 8.0)


@pytest.mark.parametrize("layout", ["published", "transformers-5"])
def test_qwen_vl_mrope_is_plain_rope_at_its_theta(layout):
    """Qwen2-VL's M-RoPE: on text its three position sections are the token's index, and vLLM hands a
    plain-rope draft the first one, so the draft is plain rope at the target's theta (not an error)."""
    mrope = {"type": "mrope", "mrope_section": [16, 24, 24]}
    text = {
        "model_type": "qwen2_vl_text",
        **SMALL,
        "rope_theta": 1_000_000.0,
        "rope_scaling": mrope,
    }
    config = (
        config_from_dict({"model_type": "qwen2_vl", "text_config": text})
        if layout == "published"
        else transformers.Qwen2VLConfig(text_config=text)
    )
    c = draft_of(config)
    assert (c.rope_theta, c.rope_scaling) == (1_000_000.0, None)
    assert "M-RoPE" in c.rope_source and "first (temporal)" in c.rope_source


def test_qwen_vl_mrope_with_yarn_keeps_the_yarn():
    """Qwen2.5-VL served past its trained length carries yarn on top of M-RoPE: the sections go (the
    draft's positions are the token's index), the yarn stays, as the target's own rotation scales."""
    scaling = {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "mrope_section": [16, 24, 24],
    }
    text = {
        "model_type": "qwen2_5_vl_text",
        **SMALL,
        "rope_theta": 1_000_000.0,
        "rope_scaling": scaling,
        "max_position_embeddings": 131072,
    }
    c = draft_of(config_from_dict({"model_type": "qwen2_5_vl", "text_config": text}))
    assert c.rope_theta == 1_000_000.0
    assert c.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert "yarn rope at the target's theta" in c.rope_source


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("layout", ["config", "transformers-4 dict", "saved dict"])
def test_llama3_scaling_in_every_layout(layout):
    config = transformers.LlamaConfig(
        **SMALL, rope_theta=500000.0, rope_scaling=dict(LLAMA3), max_position_embeddings=131072
    )
    if layout == "transformers-4 dict":
        config = config_from_dict(
            {
                "model_type": "llama",
                **SMALL,
                "max_position_embeddings": 131072,
                "rope_theta": 500000.0,
                "rope_scaling": dict(LLAMA3),
            }
        )
    elif layout == "saved dict":
        config = config_from_dict(config.to_dict())
    c = draft_of(config)
    assert c.rope_theta == 500000.0 and c.rope_scaling == LLAMA3
    assert c.max_position_embeddings == 131072


def test_yarn_is_carried_with_the_fields_the_engines_require():
    config = transformers.Qwen2Config(
        **SMALL,
        rope_theta=1_000_000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    )
    c = draft_of(config)
    assert c.rope_theta == 1_000_000.0
    assert c.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    # a yarn dict without original_max_position_embeddings gets transformers' default (vLLM requires it)
    bare = SimpleNamespace(
        rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 2.0},
        max_position_embeddings=4096,
    )
    assert target_rope(bare).scaling == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 4096,
    }


def test_linear_with_the_old_type_key():
    old = SimpleNamespace(
        rope_theta=250000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=4096,
    )
    choice = target_rope(old)
    assert (choice.theta, choice.scaling) == (250000.0, {"rope_type": "linear", "factor": 2.0})
    assert "rope_theta/rope_scaling" in choice.source


def test_no_rope_in_the_config_uses_transformers_default_and_says_so():
    choice = target_rope(SimpleNamespace(max_position_embeddings=2048))
    assert (
        choice.theta == 10000.0
        and choice.scaling is None
        and "names no rope theta" in choice.source
    )


def test_partial_rotary_is_noted_not_copied():
    choice = target_rope(
        SimpleNamespace(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            max_position_embeddings=2048,
        )
    )
    assert choice.scaling is None and "rotates 0.5 of each head" in choice.source


def test_what_the_draft_cannot_compute_is_an_error_naming_the_way_out():
    phi3 = SimpleNamespace(
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0],
            "long_factor": [2.0],
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=131072,
    )
    with pytest.raises(ConfigError, match="'longrope'") as caught:
        target_rope(phi3)
    assert "--draft-rope-theta" in caught.value.hint
    two_kinds = SimpleNamespace(
        rope_parameters={"main": {"rope_theta": 1e4}, "compress": {"rope_theta": 1e5}},
        max_position_embeddings=4096,
    )
    with pytest.raises(ConfigError, match="none is full_attention"):
        target_rope(two_kinds)
    # the explicit override: plain rope at the given theta, recorded as the user's choice
    c = DraftConfig.from_target(transformers.Phi3Config(**SMALL), 40, [1, 2, 3], rope_theta=50000.0)
    assert (c.rope_theta, c.rope_scaling) == (50000.0, None) and c.rope_source.startswith(
        "--draft-rope-theta"
    )


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_the_target_rope_reaches_the_exported_config(tmp_path, fmt):
    config = transformers.Qwen2Config(
        **SMALL,
        rope_theta=1_000_000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    )
    c = draft_of(config)
    run = make_run(
        tmp_path / "run",
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        rope_source=c.rope_source,
        max_position_embeddings=c.max_position_embeddings,
        target_architecture="Qwen2ForCausalLM",
    )
    result = export_stage.run(
        export_stage.ExportConfig(source=run, format=fmt, output=tmp_path / "out", dtype="fp32")
    )
    written = json.loads((result.output / "config.json").read_text())
    layer = written["transformer_layer_config"] if fmt == "speculators" else written
    assert layer["rope_theta"] == 1_000_000.0
    assert layer["rope_scaling"] == c.rope_scaling
    assert layer["rope_parameters"] == {**c.rope_scaling, "rope_theta": 1_000_000.0}
    # what transformers 5 builds from it (vLLM and SGLang construct a LlamaConfig from this dict)
    rebuilt = transformers.LlamaConfig(**{k: v for k, v in layer.items() if k != "architectures"})
    assert rebuilt.rope_parameters == layer["rope_parameters"]
    assert result.check is not None  # the self-check rebuilt the draft from the folder and agreed
    readme = (result.output / "README.md").read_text()
    assert "yarn" in readme and "target rope_parameters: theta 1e+06, yarn scaling" in readme
    assert written["spec_cli"]["rope_source"] == c.rope_source


def test_gemma4_proportional_rope_and_per_layer_head_dim():
    """Gemma 4: its full-attention layers' proportional rope is plain rope on part of each head (the draft,
    one Llama layer, rotates all of its head at that theta), and its head_dim differs per layer kind (a
    per-layer attribute transformers refuses to read globally): the draft takes the one most layers have."""
    from tests import tiny

    config = tiny.tiny_vlm_config("gemma4", 300)
    text = config.text_config
    assert text.per_layer_config[5].head_dim != text.per_layer_config[0].head_dim  # full vs sliding
    c = draft_of(config)
    assert (c.rope_theta, c.rope_scaling, c.head_dim) == (
        text.rope_parameters["full_attention"]["rope_theta"],
        None,
        text.per_layer_config[0].head_dim,
    )
    assert "proportional rope is plain rope" in c.rope_source
