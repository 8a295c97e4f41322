"""Vision-language targets (Llava, Qwen2-VL / 2.5 / 3, Idefics3 / SmolVLM, Gemma 3 and 4, Mistral 3,
Llama 4) on text: their language model,
under `text_config`, is what every stage runs and reads. Tiny random VLMs built here (tests/tiny.py).

- The supervision a VLM target gives for text rows equals an independent forward of the whole
  model (transformers' own hidden states and logits): the aux states are its language model's layer
  outputs, the draft-vocab distribution its logits' softmax, shifted as for any target.
- The pipeline through the CLI: build-vocab-map -> precompute -> train -> eval (greedy output identical
  to the target's) for each family.
"""

import json
import random

import pytest
import torch

from spec_cli.cli import main
from spec_cli.export.support import VLLM_SERVED
from spec_cli.target import loading
from spec_cli.target.hf_backend import HFTargetBackend
from tests import tiny
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm")
    return {family: tiny.save_tiny_vlm(root / family, family) for family in tiny.VLM_FAMILIES}


def rows(vocab: int):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(5, vocab - 8, (2, 13), generator=gen)  # text only (the image ids sit at the end)
    am = torch.ones_like(ids)
    am[1, 9:] = 0
    return ids, am, am.clone()


@pytest.mark.parametrize("family", tiny.VLM_FAMILIES)
def test_supervision_is_the_language_models_own(vlms, family):
    folder = vlms[family]
    config = loading.load_config(folder)
    assert loading.num_layers(config) == 6 and getattr(config, "text_config", None) is not None
    backend = HFTargetBackend(folder, [1, 2, 4], device="cpu", dtype="fp32")
    vocab = backend.info["vocab_size"]
    selected = torch.arange(0, vocab, 3)
    backend.set_vocab_mapping(selected)
    ids, am, lm = rows(vocab)
    batch = backend.generate_batch(ids, am, lm)
    model = loading.load_model(folder, torch.device("cpu"), torch.float32)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=am, output_hidden_states=True)
    H = backend.info["hidden_size"]
    assert H == config.text_config.hidden_size and out.hidden_states[0].shape[-1] == H
    real = am.bool()
    for k, layer in enumerate([1, 2, 4]):  # hidden_states[i + 1]: the output of decoder layer i
        torch.testing.assert_close(batch.aux_hidden[..., k * H:(k + 1) * H][real], out.hidden_states[layer + 1][real],
                                   rtol=1e-5, atol=1e-5)
    p = torch.softmax(out.logits.float(), -1)[..., selected]  # [B, T, Vd] under the full vocab's normaliser
    valid = real[:, 1:] & real[:, :-1]  # slot t learns the target's distribution at t + 1
    want = (p / p.sum(-1, keepdim=True))[:, 1:][valid]
    torch.testing.assert_close(batch.target_p[:, :-1][valid], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batch.target_mass[:, :-1][valid], p.sum(-1)[:, 1:][valid], rtol=1e-5, atol=1e-6)
    assert torch.equal(batch.target_ids[:, :-1][valid], out.logits.argmax(-1)[:, 1:][valid])
    assert torch.equal(backend.get_input_embeddings(), model.get_input_embeddings().weight)
    backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", tiny.VLM_FAMILIES)
def test_the_pipeline_runs_on_a_vlm_target(vlms, family, tmp_path, capsys):
    rng = random.Random(7)
    data = write_jsonl(tmp_path / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(16)])
    target, vm, cache, run = vlms[family], tmp_path / "vm.safetensors", tmp_path / "cache", tmp_path / "run"
    assert main(["build-vocab-map", "-t", str(target), "-d", str(data), "--draft-vocab-size", "64", "-o", str(vm),
                 "-q"]) == 0
    assert main(["precompute", "-t", str(target), "-d", str(data), "-v", str(vm), "-o", str(cache), "-q"]) == 0
    assert main(["train", "--cache", str(cache), "-v", str(vm), "-o", str(run), "--max-steps", "2",
                 "--ttt-steps", "2", "--batch-tokens", "512", "--eval-every", "0", "-q"]) == 0
    assert main(["eval", "--draft", str(run), "-t", str(target), "-p", str(data), "--num-prompts", "2",
                 "--max-new-tokens", "12", "-o", str(tmp_path / "eval"), "-q"]) == 0
    overall = json.loads((tmp_path / "eval" / "eval.json").read_text())["overall"]
    assert overall["same_as_target"] == overall["turns"] >= 2  # greedy: the target's own output
    # vLLM 0.32 serves EAGLE-3 on some of these VLM classes only (its SupportsEagle3); the engine itself
    # cannot load them in this install (no torchvision), so the export is checked without it
    architecture = loading.load_config(target).architectures[0]
    served = architecture in VLLM_SERVED
    assert served == (family in ("llava", "qwen2_5_vl", "qwen3_vl", "mistral3", "gemma4", "llama4"))
    out = tmp_path / "export"
    assert main(["export", str(run), "-f", "vllm", "-o", str(out), "--engine-check", "none", "-q"]) == (0 if served else 1)
    if served:
        config = json.loads((out / "config.json").read_text())
        assert config["target_hidden_size"] == 32 and config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    else:
        assert f"{architecture} does not implement SupportsEagle3" in capsys.readouterr().err
