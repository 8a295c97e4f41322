"""spec export's writers on a synthetic checkpoint: the exact files each engine's loader reads, the
vocab map and aux-layer conventions, and what an engine cannot serve as trained.

The expected key/shape tables below are written from the engines' loaders, not from spec_cli:
  vLLM    vllm/model_executor/models/llama_eagle3.py Eagle3LlamaForCausalLM.load_weights (midlayer. ->
          layers.0., d2t -> draft_id_to_target_id, t2d dropped, embed_tokens shared from the target)
  SGLang  python/sglang/srt/models/llama_eagle3.py LlamaForCausalLMEagle3.load_weights (model.midlayer,
          d2t -> hot_token_id = d2t + arange, t2d dropped, embed_tokens replaced by the target's)
  speculators  vllm-project/speculators Eagle3 (`layers.0.`, d2t + t2d), read by vLLM as model.layers.*
"""

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.draft.eagle3.export import sglang_aux_ids, vllm_aux_ids
from spec_cli.errors import ConfigError
from spec_cli.export import ExportError
from spec_cli.export.source import load_source
from spec_cli.stages import export as stage
from tests.export.drafts import (
    FORMATS,
    HT,
    VD,
    H,
    N,
    V,
    make_run,
    problems_of,
    read,
    selected_ids,
    tampered,
)

Q, KV, I = 4 * 8, 2 * 8, 64  # heads * head_dim, kv heads * head_dim, intermediate size


def layer_keys(prefix: str) -> dict:
    return {
        f"{prefix}input_layernorm.weight": [H],
        f"{prefix}hidden_norm.weight": [H],
        f"{prefix}post_attention_layernorm.weight": [H],
        f"{prefix}self_attn.q_proj.weight": [Q, 2 * H],
        f"{prefix}self_attn.k_proj.weight": [KV, 2 * H],
        f"{prefix}self_attn.v_proj.weight": [KV, 2 * H],
        f"{prefix}self_attn.o_proj.weight": [H, Q],
        f"{prefix}mlp.gate_proj.weight": [I, H],
        f"{prefix}mlp.up_proj.weight": [I, H],
        f"{prefix}mlp.down_proj.weight": [H, I],
    }


COMMON = {"fc.weight": [H, 3 * HT], "norm.weight": [H], "lm_head.weight": [VD, H], "d2t": [VD]}
EXPECTED_KEYS = {
    "vllm": {**COMMON, **layer_keys("midlayer.")},
    "sglang": {**COMMON, **layer_keys("midlayer.")},
    "speculators": {**COMMON, **layer_keys("layers.0."), "t2d": [V], "embed_tokens.weight": [V, H]},
}
FC_NORM_KEYS = {f"fc_norm.{j}.weight": [HT] for j in range(3)}


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- the files


@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_keys_shapes_and_dtypes(exports, fmt):
    folder = exports[fmt].output
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    _, tensors = read(folder)
    assert {k: list(v.shape) for k, v in tensors.items()} == EXPECTED_KEYS[fmt]
    assert tensors["d2t"].dtype == torch.int64
    if fmt == "speculators":
        assert tensors["t2d"].dtype == torch.bool
    floats = {v.dtype for k, v in tensors.items() if k not in ("d2t", "t2d")}
    assert floats == {torch.bfloat16}
    assert exports[fmt].check.params_loaded == len(EXPECTED_KEYS[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_fc_norm_keys_and_flags(tmp_path, fmt):
    run = make_run(tmp_path / "run", fc_norm=True, norm_output=True)
    result = stage.run(
        stage.ExportConfig(source=run, format=fmt, output=tmp_path / "out", dtype="fp32")
    )
    config, tensors = read(result.output)
    assert {k: list(v.shape) for k, v in tensors.items()} == {**EXPECTED_KEYS[fmt], **FC_NORM_KEYS}
    assert {v.dtype for k, v in tensors.items() if k not in ("d2t", "t2d")} == {torch.float32}
    assert config["fc_norm"] is True and config["norm_output"] is True
    if fmt == "speculators":  # vLLM builds the draft from transformer_layer_config
        assert config["transformer_layer_config"]["fc_norm"] is True
        assert config["transformer_layer_config"]["norm_output"] is True


def test_configs_as_each_engine_reads_them(exports):
    vllm, _ = read(exports["vllm"].output)
    assert vllm["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert (vllm["draft_vocab_size"], vllm["vocab_size"], vllm["target_hidden_size"]) == (VD, V, HT)
    assert vllm["tie_word_embeddings"] is False and vllm["norm_before_residual"] is False
    assert (vllm["num_hidden_layers"], vllm["head_dim"], vllm["rms_norm_eps"]) == (1, 8, 1e-5)
    assert vllm["rope_theta"] == 500000.0 and vllm["rope_parameters"]["rope_theta"] == 500000.0
    assert vllm["max_position_embeddings"] == 512

    sglang, _ = read(exports["sglang"].output)
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sglang["draft_vocab_size"] == VD and sglang["tie_word_embeddings"] is False
    assert "eagle_aux_hidden_state_layer_ids" not in sglang  # SGLang only reads eagle_config's

    spec, _ = read(exports["speculators"].output)
    assert spec["speculators_model_type"] == "eagle3" and spec["model_type"] == "speculators"
    assert spec["norm_before_residual"] is False  # vLLM's update_eagle3 defaults it to True
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "/models/tiny-llama"
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 1


# ----------------------------------------------------------------------------- vocab map and aux layers


@pytest.mark.parametrize("fmt", FORMATS)
def test_d2t_offsets_round_trip(exports, fmt):
    _, tensors = read(exports[fmt].output)
    d2t = tensors["d2t"]
    selected = selected_ids()
    assert torch.equal(torch.arange(VD) + d2t, selected)  # vLLM: targets = arange + d2t
    assert torch.equal(d2t + torch.arange(d2t.shape[0]), selected)  # SGLang: hot_token_id
    assert int(d2t.abs().sum()) > 0  # offsets, not an arange / zero map
    if "t2d" in tensors:
        assert torch.equal(tensors["t2d"].nonzero().flatten(), selected)


def test_aux_id_conventions():
    # spec_cli: outputs of layers 1, N//2-1, N-4; vLLM's default (2, N//2, N-3) counts layer inputs
    assert vllm_aux_ids([1, 32 // 2 - 1, 32 - 4]) == [2, 32 // 2, 32 - 3]
    # SGLang adds 1 itself (llama.py set_eagle3_layers_to_capture)
    assert sglang_aux_ids([1, 15, 28]) == [1, 15, 28]


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_unsorted_aux_layers_follow_the_engines_concatenation_order(tmp_path, fmt):
    """Engines concatenate aux states in layer order; fc's column blocks are permuted to match (the
    self-check's predictions would differ otherwise)."""
    run = make_run(tmp_path / "run", aux_layer_ids=[4, 1, 5], fc_norm=True)
    result = stage.run(stage.ExportConfig(source=run, format=fmt, output=tmp_path / "out"))
    assert result.check.aux_layer_outputs == [1, 4, 5]
    _, tensors = read(result.output)
    original = load_file(str(load_source(run).checkpoint / "model.safetensors"))
    blocks = original["fc.weight"].split(HT, dim=1)
    assert torch.equal(
        tensors["fc.weight"], torch.cat([blocks[1], blocks[0], blocks[2]], 1).bfloat16()
    )
    assert torch.equal(tensors["fc_norm.0.weight"], original["fc_norm.1.weight"].bfloat16())


def test_llama3_rope_is_written_in_both_spellings_and_checked(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    run = make_run(tmp_path / "run", rope_scaling=scaling)
    result = stage.run(stage.ExportConfig(source=run, format="vllm", output=tmp_path / "out"))
    config, _ = read(result.output)
    assert config["rope_scaling"] == scaling  # transformers 4.x
    assert config["rope_parameters"] == {**scaling, "rope_theta": 500000.0}  # transformers 5.x
    from transformers import LlamaConfig

    assert LlamaConfig(**config).rope_parameters == config["rope_parameters"]
    folder = tampered(
        result.output, tmp_path, config_fn=lambda c: c["rope_parameters"].update(factor=4.0)
    )
    found = problems_of(folder, "vllm", run)
    assert "disagree" in found and "rope_scaling" in found


# ----------------------------------------------------------------------------- refusals


def test_refuses_what_an_engine_cannot_serve_as_trained(tmp_path):
    two_layers = make_run(tmp_path / "two", num_hidden_layers=2)
    with pytest.raises(ExportError, match="decoder layers"):
        stage.run(stage.ExportConfig(source=two_layers, format="sglang", output=tmp_path / "o1"))
    odd_aux = make_run(
        tmp_path / "odd", aux_layer_ids=[2, 3, 4], target_architecture="SomeNewForCausalLM"
    )
    with pytest.raises(ExportError, match="first id is 2") as caught:
        stage.run(stage.ExportConfig(source=odd_aux, format="sglang", output=tmp_path / "o2"))
    from spec_cli.draft.eagle3 import default_aux_layers

    assert (
        f"--aux-layers {','.join(map(str, default_aux_layers(N)))} (the first is layer 1)"
        in caught.value.hint
    )
    # a 4-layer target (a small MoE's default aux layers are 0, 1, 2): layers from 1 are too few, so the
    # hint does not send the user to the defaults
    small = make_run(
        tmp_path / "small",
        aux_layer_ids=[0, 1, 2],
        target_num_layers=4,
        target_architecture="SomeNewForCausalLM",
    )
    with pytest.raises(ExportError, match="first id is 0") as caught:
        stage.run(stage.ExportConfig(source=small, format="sglang", output=tmp_path / "o5"))
    assert (
        caught.value.hint.endswith("export it with --format vllm")
        and "default" not in caught.value.hint
    )
    last = make_run(tmp_path / "last", aux_layer_ids=[1, 3, N - 1])
    with pytest.raises(ExportError, match="cannot be captured"):
        stage.run(stage.ExportConfig(source=last, format="vllm", output=tmp_path / "o3"))
    with pytest.raises(ConfigError, match="--format"):
        stage.run(stage.ExportConfig(source=last, format="onnx", output=tmp_path / "o4"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "last",
        "odd",
        "small",
        "two",
    ]  # no output written


def test_multi_layer_drafts_export_for_vllm(tmp_path):
    run = make_run(tmp_path / "run", num_hidden_layers=2)
    result = stage.run(stage.ExportConfig(source=run, format="vllm", output=tmp_path / "out"))
    _, tensors = read(result.output)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (
        Q,
        H,
    )  # later layers read H, not 2H
