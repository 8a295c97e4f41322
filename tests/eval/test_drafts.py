"""Loading the draft to evaluate: a run folder, a checkpoint, or an export of each format read the way the
engine reads it (aux layers in the engine's order, the target's embedding), and checks against the target."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_cli.errors import ArtifactError
from spec_cli.eval import drafts
from spec_cli.export import formats
from spec_cli.stages import export as export_stage
from tests.export.drafts import HT, N, V, make_run

pytestmark = pytest.mark.usefixtures("one_thread")


def target_config(**overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=V,
        hidden_size=HT,
        intermediate_size=64,
        num_hidden_layers=N,
        num_attention_heads=4,
        num_key_value_heads=2,
        architectures=["LlamaForCausalLM"],
    )
    values.update(overrides)
    return LlamaConfig(**values)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A checkpoint whose aux layers are NOT in ascending order (the engines concatenate them sorted)."""
    return make_run(tmp_path_factory.mktemp("run"), aux_layer_ids=[4, 1, 3], fc_norm=True)


@torch.no_grad()
def predictions(draft, states: dict, ids: torch.Tensor) -> torch.Tensor:
    aux = torch.cat(
        [states[i] for i in draft.config.aux_layer_ids], dim=-1
    )  # the draft's own order
    logits = draft.logits(draft(ids, aux))
    return torch.cat([logits.flatten(), draft.to_target_ids(logits.argmax(-1)).flatten().float()])


@pytest.mark.parametrize("fmt", formats())
def test_an_export_reads_back_as_the_trained_draft(run, tmp_path, fmt):
    if (
        fmt == "sglang"
    ):  # SGLang has no EAGLE-3.1 fc_norm in older versions: export a plain draft for it
        source = make_run(tmp_path / "plain", aux_layer_ids=[4, 1, 3])
    else:
        source = run
    export_stage.run(
        export_stage.ExportConfig(source=source, format=fmt, output=tmp_path / fmt, dtype="fp32")
    )
    trained = drafts.load_draft(source, target_config())
    loaded = drafts.load_draft(tmp_path / fmt, target_config())
    assert (trained.kind, loaded.kind, loaded.format, loaded.step) == ("run", "export", fmt, 5)
    assert trained.model.config.aux_layer_ids == [4, 1, 3]
    assert loaded.model.config.aux_layer_ids == [1, 3, 4]  # as the engine concatenates them
    assert not trained.needs_embeddings
    # vLLM/SGLang exports share the target's table (copied in by `spec eval`); speculators ones carry it
    assert loaded.needs_embeddings == (fmt != "speculators")
    if loaded.needs_embeddings:
        loaded.model.copy_embeddings(trained.model.embed_tokens.weight)
    else:
        assert torch.equal(
            loaded.model.embed_tokens.weight, trained.model.embed_tokens.weight
        )  # fp32 export
    assert torch.equal(loaded.model.d2t, trained.model.d2t) and torch.equal(
        loaded.model.t2d, trained.model.t2d
    )
    g = torch.Generator().manual_seed(0)
    states = {i: torch.randn(2, 12, HT, generator=g) for i in (1, 3, 4)}
    ids = torch.randint(0, V, (2, 12), generator=g)
    torch.testing.assert_close(
        predictions(loaded.model, states, ids),
        predictions(trained.model, states, ids),
        rtol=1e-5,
        atol=1e-5,
    )


def test_checkpoint_folder_and_foreign_export(run, tmp_path):
    from spec_cli.artifacts.checkpoint import latest_checkpoint
    from spec_cli.stages.eval import default_output

    checkpoint = drafts.load_draft(latest_checkpoint(run), target_config())
    assert (
        checkpoint.kind == "checkpoint"
        and default_output(checkpoint) == run / "eval" / "step-00000005"
    )
    export_stage.run(
        export_stage.ExportConfig(source=run, format="vllm", output=tmp_path / "x", dtype="fp32")
    )
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    del config["spec_cli"]  # a folder written by another tool: the format is read off the config
    (tmp_path / "x" / "config.json").write_text(json.dumps(config))
    foreign = drafts.load_draft(tmp_path / "x", target_config())
    assert (
        foreign.format == "vllm"
        and foreign.step is None
        and foreign.recorded["target_fingerprint"] == ""
    )
    assert default_output(foreign) == tmp_path / "x-eval"


def test_a_damaged_export_is_refused(run, tmp_path):
    export_stage.run(
        export_stage.ExportConfig(source=run, format="vllm", output=tmp_path / "x", dtype="fp32")
    )
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "x", broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match="lm_head.weight is not in the file"):
        drafts.load_draft(broken, target_config())


def test_a_draft_for_another_target_is_refused(run, tmp_path):
    loaded = drafts.load_draft(run, target_config())
    for overrides, words in [
        ({"hidden_size": 64}, "target hidden size 48"),
        ({"num_hidden_layers": 12}, "target num layers 8"),
        ({"vocab_size": V + 1}, "vocab size 300"),
    ]:
        with pytest.raises(ArtifactError, match=words):
            drafts.check_target(
                loaded, tmp_path, target_config(**overrides), None, check_fingerprint=False
            )
    drafts.check_target(loaded, tmp_path, target_config(), None, check_fingerprint=False)
