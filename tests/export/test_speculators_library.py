"""The speculators export loaded by the real speculators library (vllm-project/speculators 0.9.0) with
its own classes: the config as Eagle3SpeculatorConfig reads it, every weight loaded by
SpeculatorModel.from_pretrained, and its Eagle3DraftModel.forward giving the checkpoint's first-step
logits and target-id predictions. Skipped when the library is not installed:

    pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0

(the rest of what `import speculators` needs -- pydantic, datasets, openai, aiohttp, psutil, loguru --
comes with spec_cli and the vllm extra).

What speculators 0.9.0 does, as read in its source (site-packages/speculators):
  models/eagle3/config.py  Eagle3SpeculatorConfig: draft_vocab_size, target_hidden_size,
      eagle_aux_hidden_state_layer_ids, norm_before_residual / fc_norm / norm_output, and the decoder
      layer built from transformer_layer_config by its model_type (LlamaConfig here).
  models/eagle3/core.py  Eagle3DraftModel: `fc` Linear(num_aux * hidden_size, hidden_size) with the
      DRAFT hidden size (it never reads target_hidden_size, hence H_t == H below, as in every real
      spec_cli draft: the draft's embedding is the target's); `layers.0` is the EAGLE first layer.
      forward(hidden_states [1, T, 3*H], input_ids [1, T], document_ids [1, T], position_ids,
      ttt_steps) returns the draft-vocab argmax of each step; the logits are lm_head's output.
      from_pretrained checks the aux ids against the verifier's num_hidden_layers.
  model.py  DraftVocabMixin: d2t / t2d buffers; embed_tokens, when the file has none, is meant to be
      the verifier's (load_verifier_weights loads it when the weight is NaN).
"""

import importlib.util
import inspect
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_cli.draft.eagle3.model import Eagle3Draft
from spec_cli.export.source import load_source
from tests.export.drafts import VD, H, N, V, make_run

# no import at collection: `import speculators` takes seconds (torch._inductor, datasets, transformers)
if importlib.util.find_spec("speculators") is None:
    pytest.skip("the speculators library is not installed", allow_module_level=True)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

T = 24  # positions in the forward
# the speculators model keys a speculators-format file need not hold: the verifier's (load_verifier_weights)
FROM_VERIFIER = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
VARIANTS = {
    "eagle3": {},
    # EAGLE-3.1 flags, aux layers not in ascending order (the export permutes fc's column blocks)
    "eagle3.1-unsorted-aux": {"fc_norm": True, "norm_output": True, "aux_layer_ids": [4, 1, 5]},
    "two-layers": {"num_hidden_layers": 2},
}


@pytest.fixture(scope="module")
def speculators():
    return pytest.importorskip("speculators")


def save_target(folder: Path, embed: torch.Tensor) -> Path:
    """The tiny target the export names as the speculators verifier: a Llama config of the draft's
    target shape plus the three tensors speculators reads from a verifier (embed_tokens, lm_head, norm)."""
    from transformers import LlamaConfig

    LlamaConfig(
        num_hidden_layers=N,
        hidden_size=H,
        vocab_size=V,
        num_attention_heads=4,
        intermediate_size=64,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)
    g = torch.Generator().manual_seed(7)
    save_file(
        {
            "model.embed_tokens.weight": embed.contiguous(),
            "model.norm.weight": torch.ones(H),
            "lm_head.weight": torch.randn(V, H, generator=g),
        },
        str(folder / "model.safetensors"),
    )
    return folder


def spec_export(run: Path, target: Path, out: Path) -> Path:
    from spec_cli import cli
    from spec_cli.commands.export import export_cmd

    argv = [
        "export",
        str(run),
        "--format",
        "speculators",
        "--dtype",
        "fp32",
        "-o",
        str(out),
        "--target",
        str(target),
        "-q",
    ]
    if "engine_check" in inspect.signature(export_cmd).parameters:
        argv += ["--engine-check", "none"]  # vLLM's own load is another test's business
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory, one_thread):
    """(export folder, target folder, checkpoint source) for one draft variant."""
    root = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        run = make_run(root / "run", target_hidden_size=H, **VARIANTS[request.param])
        src = load_source(run)
        target = save_target(root / "target", src.state["embed_tokens.weight"])
        out = spec_export(run, target, root / "out")
    return out, target, src


def load_speculators(speculators, folder: Path):
    """speculators' own loading: SpeculatorModel.from_pretrained resolves the config class
    (Eagle3SpeculatorConfig) and the model class (Eagle3DraftModel) from the folder.

    A file without embed_tokens.weight relies on speculators' NaN sentinel (model.py DraftVocabMixin:
    `constant_(embed_tokens.weight, nan)` in __init__, then load_verifier_weights loads the verifier's
    embedding `if ... self.embed_tokens.weight.isnan().any()`). Under transformers 5 the model is built
    on the meta device and speculators marks embed_tokens `_is_hf_initialized`, so transformers'
    _initialize_weights skips it: the missing weight is left as uninitialised memory and is NaN only by
    chance. Put the sentinel back and let speculators' own loader fill it from the verifier."""
    model = speculators.SpeculatorModel.from_pretrained(str(folder)).eval()
    if "embed_tokens.weight" not in load_file(str(folder / "model.safetensors")):
        with torch.no_grad():
            model.embed_tokens.weight.fill_(float("nan"))
        model.load_verifier_weights()
    return model


def problems(speculators, folder: Path, src) -> tuple[list[str], dict]:
    """What differs between speculators' reading of `folder` and the checkpoint: weights, vocab map,
    and the first-step (no TTT) logits / target-id predictions on the same random aux states and ids."""
    found = []
    file = load_file(str(folder / "model.safetensors"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        model = load_speculators(speculators, folder)
    if type(model) is not speculators.Eagle3DraftModel:
        found.append(f"speculators built a {type(model).__name__}, not its Eagle3DraftModel")
    state = model.state_dict()

    # every weight: each file key is a model key holding exactly the file's tensor, and the only model
    # keys the file lacks are the verifier's. (from_pretrained only prints a load report, and
    # output_loading_info=True breaks Eagle3DraftModel.from_pretrained, which reads `.config` of the tuple.)
    unexpected = sorted(set(file) - set(state))
    missing = sorted(set(state) - set(file) - FROM_VERIFIER)
    changed = sorted(k for k in set(file) & set(state) if not torch.equal(file[k], state[k]))
    found += [f"{k} is not a speculators parameter" for k in unexpected]
    found += [f"{k} is not in the file (left at its random init)" for k in missing]
    found += [f"{k} loaded differently from the file" for k in changed]
    found += [
        f"{k} is not finite"
        for k, v in state.items()
        if v.is_floating_point() and not v.isfinite().all()
    ]
    if not torch.equal(model.embed_tokens.weight, src.state["embed_tokens.weight"]):
        found.append("embed_tokens is not the checkpoint's (= the target's) embedding")

    # the vocab map as speculators holds it: d2t the checkpoint's offsets, t2d exactly their target ids;
    # none for a draft over the whole target vocab (DraftVocabMixin: use_draft_vocab False)
    full = src.config.draft_vocab_size == src.config.vocab_size
    if full and (model.d2t is not None or model.t2d is not None):
        found.append("speculators holds a vocab map for a draft over the whole target vocab")
    if not full and (model.d2t is None or not torch.equal(model.d2t, src.state["d2t"])):
        found.append("d2t is not the checkpoint's")
    selected = torch.arange(src.config.draft_vocab_size) + src.state["d2t"]
    if not full and (model.t2d is None or not torch.equal(model.t2d.nonzero().flatten(), selected)):
        found.append("t2d does not mark the checkpoint's draft vocab")

    # the same per-layer aux states for both. spec_cli counts layer OUTPUTS; speculators' ids are vLLM's
    # (id k = the input of layer k = the output of layer k - 1), concatenated in the order of its ids.
    g = torch.Generator().manual_seed(3)
    layer_states = {i: torch.randn(1, T, H, generator=g) for i in src.config.aux_layer_ids}
    ids = torch.randint(0, V, (1, T), generator=g)
    spec_layers = [k - 1 for k in model.config.eagle_aux_hidden_state_layer_ids]
    if sorted(spec_layers) != sorted(layer_states):
        return found + [
            f"speculators reads the outputs of layers {spec_layers}, the draft was trained on "
            f"{src.config.aux_layer_ids}"
        ], {}
    aux_spec = torch.cat([layer_states[i] for i in spec_layers], dim=-1)  # [1, T, 3*H]
    aux_ckpt = torch.cat(
        [layer_states[i] for i in src.config.aux_layer_ids], dim=-1
    )  # checkpoint order

    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out))
    with torch.no_grad():
        draft_ids = model(
            hidden_states=aux_spec,
            input_ids=ids,
            document_ids=torch.zeros_like(ids),
            position_ids=torch.arange(T)[None],
            ttt_steps=1,
        )[0]  # [1, T] draft vocab
    hook.remove()
    spec_logits = logits[0]  # [1, T, Vd]
    # vLLM / speculators: target = draft + d2t[draft]; the draft's own ids without a map
    spec_targets = draft_ids if model.d2t is None else draft_ids + model.d2t[draft_ids]

    ckpt = Eagle3Draft(src.config)
    ckpt.load_state_dict(src.state)
    with torch.no_grad():
        ref_logits = ckpt.eval().logits(ckpt(ids, aux_ckpt))  # [1, T, Vd]
    ref_targets = ckpt.to_target_ids(ref_logits.argmax(-1))

    diff = (spec_logits - ref_logits).abs().max().item()
    if diff > 1e-4:
        found.append(f"logits differ by up to {diff:.3g}")
    if not torch.equal(draft_ids, ref_logits.argmax(-1)):
        found.append("draft-vocab argmax differs")
    if not torch.equal(spec_targets, ref_targets):
        found.append(
            f"predicted target ids differ at {int((spec_targets != ref_targets).sum())}/{T} positions"
        )
    return found, {"max_abs_logit_diff": diff, "scale": ref_logits.abs().max().item()}


def tampered(folder: Path, dest: Path, tensors_fn) -> Path:
    shutil.copytree(folder, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    tensors_fn(tensors)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


# ------------------------------------------------------------------------ the export as speculators reads it


def test_config_is_speculators_eagle3(speculators, exported):
    from transformers import LlamaConfig

    folder, target, src = exported
    c = src.config
    config = speculators.SpeculatorModelConfig.from_pretrained(
        str(folder)
    )  # resolved by speculators_model_type
    assert type(config) is speculators.Eagle3SpeculatorConfig
    assert (config.draft_vocab_size, config.target_vocab_size, config.target_hidden_size) == (
        VD,
        V,
        H,
    )
    assert config.eagle_aux_hidden_state_layer_ids == [
        i + 1 for i in sorted(c.aux_layer_ids)
    ]  # vLLM's count
    assert (config.norm_before_residual, config.norm_before_fc) == (False, False)
    assert (config.fc_norm, config.norm_output) == (c.fc_norm, c.norm_output)
    layer = config.transformer_layer_config
    assert type(layer) is LlamaConfig  # built from its model_type
    assert (layer.hidden_size, layer.intermediate_size, layer.num_hidden_layers) == (
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
    )
    assert (layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim) == (4, 2, 8)
    assert (
        layer.rope_parameters["rope_theta"] == c.rope_theta and layer.rms_norm_eps == c.rms_norm_eps
    )
    assert config.speculators_config.verifier.name_or_path == str(target)
    assert (
        config.speculators_config.proposal_methods[0].speculative_tokens == 2
    )  # the run's TTT depth


def test_loads_and_predicts_as_the_checkpoint(speculators, exported):
    folder, _, src = exported
    found, numbers = problems(speculators, folder, src)
    assert found == []
    assert numbers["max_abs_logit_diff"] < 1e-4 < numbers["scale"]


def test_a_full_vocab_draft_loads_without_a_vocab_map(speculators, tmp_path, one_thread):
    """--draft-vocab-size V: the export holds no d2t/t2d (vLLM fails on a d2t then), which is exactly what
    speculators builds for it, and it predicts as the checkpoint does."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        run = make_run(tmp_path / "run", target_hidden_size=H, draft_vocab_size=V)
        src = load_source(run)
        folder = spec_export(
            run,
            save_target(tmp_path / "target", src.state["embed_tokens.weight"]),
            tmp_path / "out",
        )
    assert not {"d2t", "t2d"} & set(load_file(str(folder / "model.safetensors")))
    found, numbers = problems(speculators, folder, src)
    assert found == [] and numbers["max_abs_logit_diff"] < 1e-4 < numbers["scale"]


def test_file_holds_the_embedding(exported):
    folder, _, _ = exported
    assert "embed_tokens.weight" in load_file(str(folder / "model.safetensors"))


# ----------------------------------------------------------------------------- and the comparison can fail


def test_zeroed_d2t_gives_wrong_target_ids(speculators, exported, tmp_path):
    folder, _, src = exported
    bad = tampered(folder, tmp_path / "bad", lambda t: t["d2t"].zero_())
    found, _ = problems(speculators, bad, src)
    assert "d2t is not the checkpoint's" in found
    assert any("predicted target ids differ" in p for p in found)


def test_renamed_key_is_a_random_weight(speculators, exported, tmp_path):
    folder, _, src = exported
    bad = tampered(
        folder,
        tmp_path / "bad",
        lambda t: t.update({"layers.0.mlp.up.weight": t.pop("layers.0.mlp.up_proj.weight")}),
    )
    found, _ = problems(speculators, bad, src)
    assert "layers.0.mlp.up.weight is not a speculators parameter" in found
    assert "layers.0.mlp.up_proj.weight is not in the file (left at its random init)" in found
    assert any("logits differ" in p for p in found)


def test_swapped_fc_blocks_change_the_logits(speculators, exported, tmp_path):
    folder, _, src = exported

    def swap(t):
        a, b, c = t["fc.weight"].split(H, dim=1)
        t["fc.weight"] = torch.cat([b, a, c], dim=1).contiguous()

    found, _ = problems(speculators, tampered(folder, tmp_path / "bad", swap), src)
    assert any("logits differ" in p for p in found)
