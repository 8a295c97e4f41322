"""spec export's self-check (export/check.py): an untouched export passes, and each kind of damage an
engine would load silently (a renamed key, a zeroed d2t, shifted aux ids, swapped fc blocks, engine
specific traps) is named."""

import shutil

import pytest
import torch

from spec_cli.export import reader
from tests.export.drafts import FORMATS, HT, H, V, problems_of, tampered

pytestmark = pytest.mark.usefixtures("one_thread")


def rename(tensors, old, new):
    tensors[new] = tensors.pop(old)


def shift_aux(fmt):
    def fn(config):
        holder = config["eagle_config"] if fmt == "sglang" else config
        holder["eagle_aux_hidden_state_layer_ids"] = [
            i + 1 for i in holder["eagle_aux_hidden_state_layer_ids"]
        ]

    return fn


@pytest.mark.parametrize("fmt", FORMATS)
def test_untouched_exports_pass(exports, run_dir, fmt):
    assert problems_of(exports[fmt].output, fmt, run_dir) == ""


@pytest.mark.parametrize("fmt", FORMATS)
def test_renamed_key_is_caught(exports, run_dir, tmp_path, fmt):
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    folder = tampered(
        exports[fmt].output,
        tmp_path,
        lambda t: rename(t, prefix + "mlp.up_proj.weight", prefix + "mlp.up.weight"),
    )
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
    folder = tampered(
        exports["speculators"].output, tmp_path, config_fn=lambda c: c.pop("norm_before_residual")
    )
    assert "norm_before_residual" in problems_of(folder, "speculators", run_dir)
    # SGLang reads aux ids only from eagle_config
    shutil.rmtree(folder)
    folder = tampered(
        exports["sglang"].output,
        tmp_path,
        config_fn=lambda c: c.update(
            eagle_aux_hidden_state_layer_ids=c.pop("eagle_config")[
                "eagle_aux_hidden_state_layer_ids"
            ]
        ),
    )
    assert "top level, where SGLang does not look" in problems_of(folder, "sglang", run_dir)
    # vLLM drops t2d, SGLang ignores the draft's embed_tokens: neither belongs in those folders
    shutil.rmtree(folder)
    folder = tampered(
        exports["vllm"].output, tmp_path, lambda t: t.update(t2d=torch.zeros(V, dtype=torch.bool))
    )
    assert "vLLM drops t2d" in problems_of(folder, "vllm", run_dir)
    shutil.rmtree(folder)
    folder = tampered(
        exports["sglang"].output,
        tmp_path,
        lambda t: t.update({"embed_tokens.weight": torch.zeros(V, H, dtype=torch.bfloat16)}),
    )
    assert "replaces the draft's embed_tokens" in problems_of(folder, "sglang", run_dir)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A --draft-window 6 run and its vLLM and speculators exports (the self-check's predictions run over
    16 positions, so the window changes them)."""
    from spec_cli.stages import export as stage
    from tests.export.drafts import make_run

    root = tmp_path_factory.mktemp("windowed")
    run = make_run(root / "run", sliding_window=6)
    return run, {
        fmt: stage.run(stage.ExportConfig(source=run, format=fmt, output=root / fmt)).output
        for fmt in ("vllm", "speculators")
    }


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_lost_or_changed_window_is_caught(windowed, tmp_path, fmt):
    """--draft-window reaches vLLM as layer_types + sliding_window (read back the way LlamaAttention
    reads them); without either, or with another size, vLLM would attend other keys than trained."""
    run, folders = windowed
    assert problems_of(folders[fmt], fmt, run) == ""
    view = reader.read(folders[fmt], fmt).view  # and `spec eval --draft EXPORT` decodes with it
    assert reader.draft_config(view, [1, 3, 4], 8).sliding_window == 6

    def edit(fn):
        def apply(config):
            fn(config["transformer_layer_config"] if fmt == "speculators" else config)

        return apply

    for n, (fn, message) in enumerate(
        [
            (
                lambda c: c.pop("layer_types"),
                "sliding_window is None for the engine, 6 in training",
            ),
            (
                lambda c: c.update(sliding_window=9),
                "sliding_window is 9 for the engine, 6 in training",
            ),
            (lambda c: c.update(layer_types=[]), "sliding_window is None for the engine"),
        ]
    ):
        folder = tampered(folders[fmt], tmp_path / str(n), config_fn=edit(fn))
        assert message in problems_of(folder, fmt, run)


def test_a_windowed_draft_is_not_exported_for_sglang(windowed, tmp_path):
    from spec_cli.errors import ExportError
    from spec_cli.stages import export as stage

    with pytest.raises(ExportError, match="SGLang reads no window"):
        stage.run(
            stage.ExportConfig(source=windowed[0], format="sglang", output=tmp_path / "sglang")
        )
    assert not (tmp_path / "sglang").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_draft_trained_on_a_repeated_aux_layer_is_refused_with_the_reason(tmp_path, fmt):
    """--aux-layers 1,3,3 trains (with a warning); the engines capture each layer once, so the export's
    self-check refuses it and says why, and nothing is written."""
    from spec_cli.errors import ArtifactError
    from spec_cli.stages import export as stage
    from tests.export.drafts import make_run

    run = make_run(tmp_path / "run", aux_layer_ids=[1, 3, 3])
    with pytest.raises(ArtifactError) as err:
        stage.run(stage.ExportConfig(source=run, format=fmt, output=tmp_path / "out"))
    assert (
        "trained on aux layers [1, 3, 3], which repeat a layer: the engine captures each layer once, so fc "
        "would get 2 states of the 3 it expects" in err.value.one_line()
    )
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def full_vocab(tmp_path_factory):
    """A draft over the whole target vocab (--draft-vocab-size V) and its export in every format."""
    from spec_cli.stages import export as stage
    from tests.export.drafts import make_run

    root = tmp_path_factory.mktemp("full-vocab")
    run = make_run(root / "run", draft_vocab_size=V)
    return run, {
        fmt: stage.run(stage.ExportConfig(source=run, format=fmt, output=root / fmt)).output
        for fmt in FORMATS
    }


def test_a_full_vocab_draft_is_written_as_each_engine_reads_it(full_vocab, tmp_path):
    """vLLM builds no draft_id_to_target_id when draft_vocab_size is the target's vocab_size and fails on a
    d2t key; the speculators library then keeps no d2t/t2d; SGLang reads d2t as hot_token_id at any size."""
    from tests.export.drafts import read

    run, folders = full_vocab
    keys = {fmt: set(read(folders[fmt])[1]) for fmt in FORMATS}
    assert not keys["vllm"] & {"d2t", "t2d"} and not keys["speculators"] & {"d2t", "t2d"}
    assert "d2t" in keys["sglang"]
    for fmt in FORMATS:
        assert problems_of(folders[fmt], fmt, run) == ""
        assert torch.equal(reader.read(folders[fmt], fmt).targets, torch.arange(V))  # the identity
    with_map = tampered(
        folders["vllm"], tmp_path, lambda t: t.update(d2t=torch.zeros(V, dtype=torch.int64))
    )
    assert (
        "'d2t': vLLM has no draft_id_to_target_id when draft_vocab_size equals vocab_size, and its loader "
        "fails on the key"
    ) in problems_of(with_map, "vllm", run)


def test_spec_eval_reads_a_full_vocab_export(full_vocab):
    """`spec eval --draft EXPORT` reads the vLLM folder (no d2t) as the draft vLLM serves: target ids are
    the draft's own."""
    from transformers import LlamaConfig

    from spec_cli.eval import drafts
    from tests.export.drafts import N

    run, folders = full_vocab
    target = LlamaConfig(vocab_size=V, hidden_size=HT, num_hidden_layers=N, num_attention_heads=4)
    loaded = drafts.load_draft(folders["vllm"], target)
    assert loaded.model.config.draft_vocab_size == V
    assert torch.equal(loaded.model.to_target_ids(torch.arange(V)), torch.arange(V))
