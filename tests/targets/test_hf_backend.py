"""The in-process transformers backend: its hooked aux states are the model's own hidden states at the
chosen layers, the final state gives the model's logits, and its output head is the target's."""

import pytest
import torch

from spec_cli.errors import ConfigError
from spec_cli.targets import loading
from spec_cli.targets.hf_backend import HFTargetBackend

AUX = [2, 5, 6]  # not the default ids; 6 is the output of the second-to-last layer (of 8)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    b = HFTargetBackend(
        tiny_llama_dir, aux_layers=",".join(map(str, AUX)), device="cpu", dtype="fp32"
    )
    gen = torch.Generator().manual_seed(0)
    b.set_vocab_mapping(torch.sort(torch.randperm(400, generator=gen)[:64]).values)
    yield b
    b.close()


def test_aux_states_are_the_hidden_states_of_the_chosen_layers(backend):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 400, (2, 11), generator=gen)
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, 7:] = 0  # a right-padded row
    aux, final = backend.run_target(ids, am)
    H = backend.info["hidden_size"]
    assert aux.shape == (2, 11, 3 * H) and final.shape == (2, 11, H)
    with torch.no_grad():
        out = backend.model(input_ids=ids, attention_mask=am, output_hidden_states=True)
    real = am.bool()
    for k, layer in enumerate(
        AUX
    ):  # hidden_states[0] is the embedding output, [i + 1] layer i's output
        torch.testing.assert_close(
            aux[..., k * H : (k + 1) * H][real],
            out.hidden_states[layer + 1][real],
            rtol=1e-6,
            atol=1e-6,
        )
    torch.testing.assert_close(
        final[real], out.hidden_states[-1][real], rtol=1e-6, atol=1e-6
    )  # normed
    torch.testing.assert_close(
        (final @ backend.model.lm_head.weight.T)[real], out.logits[real], rtol=1e-5, atol=1e-5
    )


def test_info_describes_the_target(backend, tiny_llama_dir):
    info = backend.info
    assert (info["architecture"], info["num_layers"], info["aux_layers"]) == (
        "LlamaForCausalLM",
        8,
        AUX,
    )
    assert (info["vocab_size"], info["hidden_size"], info["dtype"]) == (400, 32, "float32")
    assert info["target_fingerprint"] == loading.target_fingerprint(tiny_llama_dir)
    assert torch.equal(backend.get_input_embeddings(), backend.model.model.embed_tokens.weight)


def test_bad_aux_layers_are_refused_before_the_model_loads(tiny_llama_dir, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    with pytest.raises(
        ConfigError, match=r"--aux-layers \[7\] out of range: the target has 8 decoder layers"
    ):
        HFTargetBackend(tiny_llama_dir, aux_layers="1,2,7", device="cpu", dtype="fp32")
    with pytest.raises(
        ConfigError, match=r"--aux-layers \[7\] out of range"
    ):  # a list: the stage chose it
        HFTargetBackend(tiny_llama_dir, aux_layers=[1, 2, 7], device="cpu", dtype="fp32")


def test_a_vocab_map_beyond_the_targets_vocab_is_refused(backend):
    with pytest.raises(ConfigError, match="ids beyond this target's vocab"):
        backend.set_vocab_mapping(torch.tensor([3, 400]))


def test_output_head_is_the_targets_lm_head_rows_and_final_norm(backend):
    head = backend.get_output_head()
    sel = backend.selected
    assert torch.equal(head["lm_head_selected"], backend.model.lm_head.weight[sel])
    # RMSNorm of a ones vector is its per-channel scale: for Llama that is the weight itself
    torch.testing.assert_close(
        head["final_norm"], backend.model.model.norm.weight.detach(), rtol=1e-5, atol=1e-6
    )
    # and the scale reproduces the norm on any input (independent of how it was read)
    x = torch.randn(4, head["final_norm"].numel())
    rms = x.pow(2).mean(-1, keepdim=True).add(backend.model.model.norm.variance_epsilon).rsqrt()
    torch.testing.assert_close(
        backend.model.model.norm(x), x * rms * head["final_norm"], rtol=1e-5, atol=1e-5
    )


def test_final_norm_scale_reads_gemmas_one_plus_weight_form():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from spec_cli.targets.hf_backend import final_norm_scale

    norm = GemmaRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 16))
    torch.testing.assert_close(final_norm_scale(norm, 16), 1.0 + torch.linspace(-0.5, 0.5, 16))
    assert final_norm_scale(torch.nn.LayerNorm(16), 16) is None  # not an RMSNorm: left alone
