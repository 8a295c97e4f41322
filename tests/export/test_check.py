"""spec export's self-check (export/check.py): an untouched export passes, and each kind of damage an
engine would load silently (a renamed key, a zeroed d2t, shifted aux ids, swapped fc blocks, engine
specific traps) is named."""

import shutil

import pytest
import torch

from tests.export.drafts import FORMATS, H, HT, V, problems_of, tampered

pytestmark = pytest.mark.usefixtures("one_thread")


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
