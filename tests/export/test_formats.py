"""spec export's formats on a synthetic checkpoint: the exact files each engine's loader reads, the
vocab map and aux-layer conventions, refusals, and a self-check that catches damaged exports.

The expected key/shape tables below are written from the engines' loaders, not from spec_cli:
  vLLM    vllm/model_executor/models/llama_eagle3.py Eagle3LlamaForCausalLM.load_weights (midlayer. ->
          layers.0., d2t -> draft_id_to_target_id, t2d dropped, embed_tokens shared from the target)
  SGLang  python/sglang/srt/models/llama_eagle3.py LlamaForCausalLMEagle3.load_weights (model.midlayer,
          d2t -> hot_token_id = d2t + arange, t2d dropped, embed_tokens replaced by the target's)
  speculators  vllm-project/speculators Eagle3 (`layers.0.`, d2t + t2d), read by vLLM as model.layers.*
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_cli.errors import ConfigError
from spec_cli.export import ExportCheckError, ExportError
from spec_cli.export.check import find_problems
from spec_cli.export.engines import captured_layer_outputs, read_sglang, read_speculators, read_vllm
from spec_cli.export.source import load_source
from spec_cli.export.writers import sglang_aux_ids, vllm_aux_ids
from spec_cli.stages import export as stage
from tests.export.drafts import H, HT, N, V, VD, make_run, selected_ids

Q, KV, I = 4 * 8, 2 * 8, 64  # heads * head_dim, kv heads * head_dim, intermediate size


def layer_keys(prefix: str) -> dict:
    return {f"{prefix}input_layernorm.weight": [H], f"{prefix}hidden_norm.weight": [H],
            f"{prefix}post_attention_layernorm.weight": [H],
            f"{prefix}self_attn.q_proj.weight": [Q, 2 * H], f"{prefix}self_attn.k_proj.weight": [KV, 2 * H],
            f"{prefix}self_attn.v_proj.weight": [KV, 2 * H], f"{prefix}self_attn.o_proj.weight": [H, Q],
            f"{prefix}mlp.gate_proj.weight": [I, H], f"{prefix}mlp.up_proj.weight": [I, H],
            f"{prefix}mlp.down_proj.weight": [H, I]}


COMMON = {"fc.weight": [H, 3 * HT], "norm.weight": [H], "lm_head.weight": [VD, H], "d2t": [VD]}
EXPECTED_KEYS = {
    "vllm": {**COMMON, **layer_keys("midlayer.")},
    "sglang": {**COMMON, **layer_keys("midlayer.")},
    "speculators": {**COMMON, **layer_keys("layers.0."), "t2d": [V], "embed_tokens.weight": [V, H]},
}
FC_NORM_KEYS = {f"fc_norm.{j}.weight": [HT] for j in range(3)}
FORMATS = list(EXPECTED_KEYS)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def exports(run_dir, tmp_path_factory):
    """One checked export per format (bf16)."""
    root = tmp_path_factory.mktemp("exports")
    return {fmt: stage.run(stage.ExportConfig(source=run_dir, format=fmt, output=root / fmt)) for fmt in FORMATS}


def read(folder: Path) -> tuple[dict, dict]:
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


# ----------------------------------------------------------------------------- the files


@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_keys_shapes_and_dtypes(exports, fmt):
    folder = exports[fmt].output
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
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
    result = stage.run(stage.ExportConfig(source=run, format=fmt, output=tmp_path / "out", dtype="fp32"))
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


def test_aux_ids_written_and_decoded_per_engine(exports):
    vllm, _ = read(exports["vllm"].output)
    sglang, _ = read(exports["sglang"].output)
    spec, _ = read(exports["speculators"].output)
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    for view in (read_vllm(vllm), read_sglang(sglang), read_speculators(spec)):
        assert captured_layer_outputs(view, N, "LlamaForCausalLM") == ([1, 3, 4], None)


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
    assert torch.equal(tensors["fc.weight"], torch.cat([blocks[1], blocks[0], blocks[2]], 1).bfloat16())
    assert torch.equal(tensors["fc_norm.0.weight"], original["fc_norm.1.weight"].bfloat16())


# ----------------------------------------------------------------------------- the self-check catches damage


def tampered(folder: Path, tmp_path: Path, tensors_fn=None, config_fn=None) -> Path:
    copy = tmp_path / "tampered"
    shutil.copytree(folder, copy)
    config, tensors = read(copy)
    if tensors_fn:
        tensors_fn(tensors)
        save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    if config_fn:
        config_fn(config)
        (copy / "config.json").write_text(json.dumps(config))
    return copy


def problems_of(folder, fmt, run_dir):
    problems, _ = find_problems(folder, fmt, load_source(run_dir), torch.bfloat16)
    return " | ".join(problems)


def rename(tensors, old, new):
    tensors[new] = tensors.pop(old)


def shift_aux(fmt):
    def fn(config):
        holder = config["eagle_config"] if fmt == "sglang" else config
        holder["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in holder["eagle_aux_hidden_state_layer_ids"]]
    return fn


@pytest.mark.parametrize("fmt", FORMATS)
def test_untouched_exports_pass(exports, run_dir, fmt):
    assert problems_of(exports[fmt].output, fmt, run_dir) == ""


@pytest.mark.parametrize("fmt", FORMATS)
def test_renamed_key_is_caught(exports, run_dir, tmp_path, fmt):
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    folder = tampered(exports[fmt].output, tmp_path, lambda t: rename(
        t, prefix + "mlp.up_proj.weight", prefix + "mlp.up.weight"))
    found = problems_of(folder, fmt, run_dir)
    assert "mlp.up.weight" in found  # skipped (SGLang) or rejected (vLLM)
    assert "up_proj" in found  # and the engine's up_proj keeps its random init


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeroed_d2t_is_caught(exports, run_dir, tmp_path, fmt):
    folder = tampered(exports[fmt].output, tmp_path, lambda t: t["d2t"].zero_())
    assert "wrong target ids" in problems_of(folder, fmt, run_dir)


@pytest.mark.parametrize("fmt", FORMATS)
def test_shifted_aux_ids_are_caught(exports, run_dir, tmp_path, fmt):
    folder = tampered(exports[fmt].output, tmp_path, config_fn=shift_aux(fmt))
    assert "outputs of layers [2, 4, 5]" in problems_of(folder, fmt, run_dir)


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_lm_head_is_caught(exports, run_dir, tmp_path, fmt):
    folder = tampered(exports[fmt].output, tmp_path, lambda t: t.pop("lm_head.weight"))
    assert "lm_head.weight is not in the file" in problems_of(folder, fmt, run_dir)


def test_swapped_fc_blocks_are_caught_by_the_predictions(exports, run_dir, tmp_path):
    def swap(t):
        a, b, c = t["fc.weight"].split(HT, dim=1)
        t["fc.weight"] = torch.cat([b, a, c], dim=1).contiguous()
    folder = tampered(exports["vllm"].output, tmp_path, swap)
    assert "predictions differ" in problems_of(folder, "vllm", run_dir)


def test_engine_specific_traps_are_caught(exports, run_dir, tmp_path):
    # speculators: without norm_before_residual vLLM's update_eagle3 turns it ON
    folder = tampered(exports["speculators"].output, tmp_path,
                      config_fn=lambda c: c.pop("norm_before_residual"))
    assert "norm_before_residual" in problems_of(folder, "speculators", run_dir)
    # SGLang reads aux ids only from eagle_config
    shutil.rmtree(folder)
    folder = tampered(exports["sglang"].output, tmp_path, config_fn=lambda c: c.update(
        eagle_aux_hidden_state_layer_ids=c.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]))
    assert "top level, where SGLang does not look" in problems_of(folder, "sglang", run_dir)
    # vLLM drops t2d, SGLang ignores the draft's embed_tokens: neither belongs in those folders
    shutil.rmtree(folder)
    folder = tampered(exports["vllm"].output, tmp_path, lambda t: t.update(t2d=torch.zeros(V, dtype=torch.bool)))
    assert "vLLM drops t2d" in problems_of(folder, "vllm", run_dir)
    shutil.rmtree(folder)
    folder = tampered(exports["sglang"].output, tmp_path,
                      lambda t: t.update({"embed_tokens.weight": torch.zeros(V, H, dtype=torch.bfloat16)}))
    assert "replaces the draft's embed_tokens" in problems_of(folder, "sglang", run_dir)


# ----------------------------------------------------------------------------- refusals and safety


def test_refuses_what_an_engine_cannot_serve_as_trained(tmp_path):
    two_layers = make_run(tmp_path / "two", num_hidden_layers=2)
    with pytest.raises(ExportError, match="decoder layers"):
        stage.run(stage.ExportConfig(source=two_layers, format="sglang", output=tmp_path / "o1"))
    odd_aux = make_run(tmp_path / "odd", aux_layer_ids=[2, 3, 4], target_architecture="SomeNewForCausalLM")
    with pytest.raises(ExportError, match="first id is 2"):
        stage.run(stage.ExportConfig(source=odd_aux, format="sglang", output=tmp_path / "o2"))
    last = make_run(tmp_path / "last", aux_layer_ids=[1, 3, N - 1])
    with pytest.raises(ExportError, match="cannot be captured"):
        stage.run(stage.ExportConfig(source=last, format="vllm", output=tmp_path / "o3"))
    with pytest.raises(ConfigError, match="--format"):
        stage.run(stage.ExportConfig(source=last, format="onnx", output=tmp_path / "o4"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "odd", "two"]  # no output written


def test_multi_layer_drafts_export_for_vllm(tmp_path):
    run = make_run(tmp_path / "run", num_hidden_layers=2)
    result = stage.run(stage.ExportConfig(source=run, format="vllm", output=tmp_path / "out"))
    _, tensors = read(result.output)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (Q, H)  # later layers read H, not 2H


def test_a_failed_check_leaves_nothing_and_keeps_the_old_export(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    stage.run(stage.ExportConfig(source=run_dir, format="vllm", output=out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_build = stage.build

    def broken_build(*args, **kwargs):  # a writer bug: arange instead of offsets
        files = real_build(*args, **kwargs)
        files.tensors["d2t"] = torch.zeros_like(files.tensors["d2t"])
        return files

    monkeypatch.setattr(stage, "build", broken_build)
    with pytest.raises(ExportCheckError, match="wrong target ids"):
        stage.run(stage.ExportConfig(source=run_dir, format="vllm", output=out, overwrite=True))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder left
    with pytest.raises(ExportCheckError):
        stage.run(stage.ExportConfig(source=run_dir, format="vllm", output=tmp_path / "new" / "deeper"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nor the parents it created


def test_never_replaces_a_folder_that_is_not_an_export(run_dir, tmp_path):
    precious = tmp_path / "models"
    precious.mkdir()
    (precious / "weights.bin").write_text("keep me")
    with pytest.raises(ConfigError, match="not a spec export"):
        stage.run(stage.ExportConfig(source=run_dir, format="vllm", output=precious))
    assert (precious / "weights.bin").read_text() == "keep me"


def test_fp16_and_readme(run_dir, tmp_path):
    result = stage.run(stage.ExportConfig(source=run_dir, format="sglang", output=tmp_path / "out",
                                          dtype="fp16", target="meta-llama/Llama-3.1-8B-Instruct"))
    _, tensors = read(result.output)
    assert tensors["fc.weight"].dtype == torch.float16
    readme = (result.output / "README.md").read_text()
    assert ("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
            "--speculative-algorithm EAGLE3 --speculative-draft-model-path") in readme
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in readme
    assert "0.500, 0.300" in readme and "1.650" in readme  # the eval at the checkpoint's step (5), not 9
    assert "t" * 16 in readme and "LlamaForCausalLM" in readme


def test_llama3_rope_is_written_in_both_spellings_and_checked(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    run = make_run(tmp_path / "run", rope_scaling=scaling)
    result = stage.run(stage.ExportConfig(source=run, format="vllm", output=tmp_path / "out"))
    config, _ = read(result.output)
    assert config["rope_scaling"] == scaling  # transformers 4.x
    assert config["rope_parameters"] == {**scaling, "rope_theta": 500000.0}  # transformers 5.x
    from transformers import LlamaConfig

    assert LlamaConfig(**config).rope_parameters == config["rope_parameters"]
    folder = tampered(result.output, tmp_path, config_fn=lambda c: c["rope_parameters"].update(factor=4.0))
    found = problems_of(folder, "vllm", run)
    assert "disagree" in found and "rope_scaling" in found


def test_refuses_a_target_of_another_shape(run_dir, tmp_path):
    from transformers import LlamaConfig

    other = tmp_path / "other-target"
    LlamaConfig(num_hidden_layers=N, hidden_size=64, vocab_size=V, num_attention_heads=4).save_pretrained(other)
    with pytest.raises(ConfigError, match="trained for"):
        stage.run(stage.ExportConfig(source=run_dir, format="vllm", output=tmp_path / "out", target=str(other)))
    same = tmp_path / "same-target"
    LlamaConfig(num_hidden_layers=N, hidden_size=HT, vocab_size=V, num_attention_heads=4).save_pretrained(same)
    result = stage.run(stage.ExportConfig(source=run_dir, format="speculators", output=tmp_path / "out",
                                          target=str(same)))
    config, _ = read(result.output)
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(same)
