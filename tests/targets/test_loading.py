"""Target loading: layer discovery across layouts, aux-layer rules, device/dtype defaults."""

import pytest
import torch
from torch import nn

from spec_cli.errors import ConfigError, TargetError
from spec_cli.targets import loading
from tests import tiny


@pytest.mark.parametrize("family", ["llama3", "chatml", "qwen3-think", "mistral", "gemma"])
def test_decoder_layers_found_for_each_family(family):
    from transformers import AutoModelForCausalLM

    config = tiny.tiny_config(family, 100)
    model = AutoModelForCausalLM.from_config(config)
    layers = loading.decoder_layers(model)
    assert len(layers) == 8
    assert all(a is b for a, b in zip(layers, model.model.layers))


def test_gemma3_multimodal_layers_and_depth_from_text_config():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
    )
    assert getattr(config, "num_hidden_layers", None) is None
    assert loading.num_layers(config) == 6
    model = Gemma3ForConditionalGeneration(config)
    layers = loading.decoder_layers(model)
    # the vision tower has 6 layers too: the language model's must be chosen
    assert all(a is b for a, b in zip(layers, model.model.language_model.layers))


def test_module_dict_layers():
    class Cfg:
        num_hidden_layers = 4

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Cfg()
            self.layers = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in (3, 1, 0, 2)})

    model = Model()
    layers = loading.decoder_layers(model)
    assert [layers[i] for i in range(4)] == [model.layers[str(i)] for i in range(4)]


def test_aux_layer_defaults_and_validation():
    assert loading.default_aux_layers(30) == [1, 14, 26]  # SmolLM2
    assert loading.default_aux_layers(32) == [1, 15, 28]  # Llama-3-8B
    assert loading.parse_aux_layers(None, 30) == [1, 14, 26]
    assert loading.parse_aux_layers("2,10,20", 30) == [2, 10, 20]
    with pytest.raises(ConfigError, match="out of range"):
        loading.parse_aux_layers("1,14,30", 30)
    with pytest.raises(ConfigError, match="out of range") as err:
        loading.parse_aux_layers("1,14,29", 30)
    assert "last layer's output cannot be served" in err.value.hint
    assert loading.parse_aux_layers("0,14,28", 30) == [0, 14, 28]
    with pytest.raises(ConfigError, match="out of range"):
        loading.parse_aux_layers("-1,14,20", 30)
    assert loading.parse_aux_layers("1,14,14", 30) == [
        1,
        14,
        14,
    ]  # typed: a warning (vLLM cannot serve it)
    # EAGLE-3's rule [1, N//2-1, N-4] repeats a layer at N = 5, 6; vLLM captures each layer once
    # (sorted(set(...))), so the default spreads three distinct layers there instead
    assert loading.default_aux_layers(6) == [1, 2, 4] and loading.default_aux_layers(5) == [1, 2, 3]
    assert loading.parse_aux_layers(None, 6) == [1, 2, 4]
    assert all(len(set(loading.default_aux_layers(n))) == 3 for n in range(4, 200))
    with pytest.raises(ConfigError, match="exactly 3"):
        loading.parse_aux_layers("1,14", 30)
    with pytest.raises(ConfigError, match="comma-separated"):
        loading.parse_aux_layers("one,two,three", 30)


def test_device_and_dtype_defaults():
    assert loading.choose_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert loading.choose_dtype(None, torch.device("cpu")) == torch.float32
    assert loading.choose_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert loading.choose_dtype("fp16", torch.device("cpu")) == torch.float16
    with pytest.raises(ConfigError, match="unknown --dtype"):
        loading.choose_dtype("int3", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            loading.choose_device("cuda")


def test_load_tiny_target_folder(tiny_llama_dir, tmp_path):
    assert loading.resolve_target(tiny_llama_dir) == tiny_llama_dir
    model = loading.load_model(tiny_llama_dir, torch.device("cpu"), torch.float32)
    assert not any(p.requires_grad for p in model.parameters())
    assert loading.vocab_size(model.config) == 400
    with pytest.raises(TargetError, match="does not exist"):
        loading.resolve_target(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="no config.json"):
        loading.resolve_target(tmp_path / "empty")


def test_fingerprints_track_what_matters(tiny_tokenizer_dirs):
    a = loading.load_tokenizer(tiny_tokenizer_dirs["chatml"])
    b = loading.load_tokenizer(tiny_tokenizer_dirs["chatml"])
    c = loading.load_tokenizer(tiny_tokenizer_dirs["qwen3-think"])  # same vocab, other template
    assert loading.tokenizer_fingerprint(a) == loading.tokenizer_fingerprint(b)
    assert loading.tokenizer_fingerprint(a) != loading.tokenizer_fingerprint(c)


@pytest.mark.parametrize(
    "amx, avx512_bf16, native", [(True, False, True), (False, True, True), (False, False, False)]
)
def test_bf16_is_suggested_only_where_the_cpu_runs_it_natively(
    monkeypatch, amx, avx512_bf16, native
):
    # the probes decide on a CPU whose kernels go past AVX2 (an AVX2-only machine runs this test too)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    cpu = torch.device("cpu")
    assert loading.fast_bf16(cpu) is native
    hint = loading.bf16_hint(None, cpu)
    assert (hint is not None) is native
    if native:
        assert "--dtype bf16" in hint
    assert loading.bf16_hint("fp32", cpu) is None  # an explicit choice is never second-guessed
    assert loading.bf16_hint("bf16", cpu) is None
    assert loading.choose_dtype(None, cpu) == torch.float32  # the default stays fp32 either way


def test_bf16_probe_missing_from_torch_means_not_native(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    assert loading.fast_bf16(torch.device("cpu")) is False


def test_a_supervising_target_asks_for_flash_attention_on_a_gpu_in_16_bit_where_installed(
    monkeypatch,
):
    import transformers.utils

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    assert loading.supervision_attention(cuda, torch.bfloat16) == "flash_attention_2"
    assert loading.supervision_attention(cuda, torch.float16) == "flash_attention_2"
    assert loading.supervision_attention(cuda, torch.float32) is None  # flash attention has no fp32
    assert loading.supervision_attention(cpu, torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100
    assert (
        loading.supervision_attention(cuda, torch.bfloat16) is None
    )  # flash attention 2 needs sm80+
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    assert loading.supervision_attention(cuda, torch.bfloat16) is None  # not installed: sdpa


def test_a_target_that_does_not_take_the_attention_loads_with_the_default(tiny_llama_dir, capsys):
    """flash-attn installed but the architecture (or the package's build) refuses it: a warning, and the
    target as before; asking for nothing loads the default."""
    model = loading.load_model(
        tiny_llama_dir, torch.device("cpu"), torch.float32, attention="no_such_attention"
    )
    assert model.config._attn_implementation == "sdpa"
    assert "does not load with no_such_attention" in capsys.readouterr().err
