"""spec export end to end: a tiny draft trained through the real CLI, exported for every engine; and what
the stage does around the writers (a failed check, a folder that is not an export, another target),
on a synthetic run."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.cli import main
from spec_cli.draft.eagle3 import EAGLE3
from spec_cli.draft.eagle3 import implementation as eagle3_code
from spec_cli.errors import ConfigError
from spec_cli.export import ExportCheckError
from spec_cli.stages import export as stage
from tests import tiny
from tests.conftest import write_jsonl
from tests.draft.runs import own_home, vocab_and_cache
from tests.export.drafts import HT, N, V, make_run, read

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama_dir):
    """Tiny Llama target -> vocab map -> feature cache -> a 4-step draft run, all through the CLI."""
    root = tmp_path_factory.mktemp("export")
    data = write_jsonl(
        root / "chat.jsonl", [tiny.random_sharegpt(random.Random(5)) for _ in range(24)]
    )
    vocab_and_cache(root, tiny_llama_dir, data, 64, "--batch-tokens", "512")
    with own_home(root):
        assert (
            main(
                [
                    "train",
                    "--cache",
                    str(root / "cache"),
                    "-v",
                    str(root / "vm.safetensors"),
                    "-o",
                    str(root / "run"),
                    "--ttt-steps",
                    "2",
                    "--max-steps",
                    "4",
                    "--lr",
                    "3e-3",
                    "--batch-tokens",
                    "512",
                    "--eval-fraction",
                    "0.2",
                    "--eval-every",
                    "2",
                    "--save-every",
                    "2",
                    "--log-every",
                    "2",
                    "-q",
                ]
            )
            == 0
        )
    return {"root": root, "run": root / "run", "target": tiny_llama_dir}


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_export_each_format_through_the_cli(trained, tmp_path, fmt, capsys):
    out = tmp_path / fmt
    assert main(["export", str(trained["run"]), "--format", fmt, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "self-check" in printed and "passed" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]

    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    source = ckpt.latest_checkpoint(trained["run"])
    trained_state = load_file(str(source / "model.safetensors"))
    draft_config = json.loads((source / "config.json").read_text())
    assert source.name == "step-00000004"
    assert torch.equal(tensors["d2t"], trained_state["d2t"])  # offsets, as trained
    assert "embed_tokens.weight" not in trained_state  # stored once per run, not per checkpoint
    frozen = load_file(str(trained["run"] / ckpt.FROZEN))
    if fmt == "speculators":  # the speculators library needs the table in the file: the run's one
        assert torch.equal(tensors["embed_tokens.weight"], frozen["embed_tokens.weight"].bfloat16())
    else:
        assert "embed_tokens.weight" not in tensors  # vLLM and SGLang use the target's table
    aux = draft_config[
        "aux_layer_ids"
    ]  # spec_cli convention: layer outputs ([1, 3, 4] for 8 layers)
    if fmt == "sglang":
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == aux
    else:
        assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in aux]

    readme = (out / "README.md").read_text()
    assert str(trained["target"]) in readme  # the target the cache was made from
    records = [json.loads(line) for line in (trained["run"] / "log.jsonl").read_text().splitlines()]
    last_eval = [r for r in records if r["split"] == "eval"][-1]
    assert f"{last_eval['acceptance_length']:.3f}" in readme
    if fmt != "sglang":
        assert "vllm serve" in readme and '"method": "eagle3"' in readme


def test_export_a_chosen_checkpoint_without_the_check(trained, tmp_path, capsys):
    first = ckpt.checkpoint_dirs(trained["run"])[0]
    out = tmp_path / "out"
    assert (
        main(
            [
                "export",
                str(first),
                "-f",
                "vllm",
                "-o",
                str(out),
                "--no-check",
                "--dtype",
                "fp32",
                "-q",
            ]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["spec_cli"]["step"] == 2 and config["torch_dtype"] == "float32"
    # exporting again over it is refused, naming what is there; --overwrite replaces it
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["export", str(trained["run"]), "-f", "sglang", "-o", str(out), "-q"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"already holds a vllm export of step 2 ({first})" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert (
        main(["export", str(trained["run"]), "-f", "vllm", "-o", str(out), "--overwrite", "-q"])
        == 0
    )
    assert json.loads((out / "config.json").read_text())["spec_cli"]["step"] == 4


def test_bad_input_fails_in_one_line_and_writes_nothing(trained, tmp_path, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    out = tmp_path / "out"
    assert main(["export", str(empty), "--format", "vllm", "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error:")
        and "holds no draft checkpoint" in err
        and len(err.splitlines()) == 1
    )
    assert main(["export", str(trained["run"]), "--format", "tensorrt", "-o", str(out)]) == 1
    assert "--format" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-run"]


def test_a_checkpoint_moved_out_of_its_run_exports_with_the_frozen_file_beside_it(
    trained, tmp_path, capsys
):
    """The embedding is in RUN/frozen.safetensors: a lone checkpoint folder says where it is, and
    exports once that file is copied beside it (a file of another run is refused by fingerprint)."""
    import shutil

    lone = tmp_path / "step-4"
    shutil.copytree(ckpt.latest_checkpoint(trained["run"]), lone)
    assert main(["export", str(lone), "-f", "speculators", "-o", str(tmp_path / "a"), "-q"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "saved without its frozen embed_tokens.weight" in err and "frozen.safetensors" in err
    from spec_cli.artifacts.io import write_safetensors

    write_safetensors(
        lone / ckpt.FROZEN,
        {"embed_tokens.weight": torch.zeros(3, 3)},
        {"kind": "frozen_weights", "fingerprint": "0" * 16, "keys": ["embed_tokens.weight"]},
    )
    assert main(["export", str(lone), "-f", "speculators", "-o", str(tmp_path / "b"), "-q"]) == 1
    assert "are not in" in capsys.readouterr().err
    shutil.copy(trained["run"] / ckpt.FROZEN, lone / ckpt.FROZEN)
    assert main(["export", str(lone), "-f", "speculators", "-o", str(tmp_path / "c"), "-q"]) == 0
    assert torch.equal(
        load_file(str(tmp_path / "c" / "model.safetensors"))["embed_tokens.weight"],
        load_file(str(lone / ckpt.FROZEN))["embed_tokens.weight"].bfloat16(),
    )


# ----------------------------------------------------------------------------- the stage around the writers


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A synthetic run with one checkpoint (tests/export/drafts.py): no training needed."""
    return make_run(tmp_path_factory.mktemp("run"))


def test_a_failed_check_leaves_nothing_and_keeps_the_old_export(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    stage.run(stage.ExportConfig(source=run_dir, format="vllm", output=out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_build = EAGLE3.export

    def broken_build(*args, **kwargs):  # a writer bug: arange instead of offsets
        files = real_build(*args, **kwargs)
        files.tensors["d2t"] = torch.zeros_like(files.tensors["d2t"])
        return files

    monkeypatch.setattr(eagle3_code, "export", broken_build)  # what EAGLE3.export loads
    with pytest.raises(ExportCheckError, match="wrong target ids"):
        stage.run(stage.ExportConfig(source=run_dir, format="vllm", output=out, overwrite=True))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder left
    with pytest.raises(ExportCheckError):
        stage.run(
            stage.ExportConfig(source=run_dir, format="vllm", output=tmp_path / "new" / "deeper")
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nor the parents it created


def test_never_replaces_a_folder_that_is_not_an_export(run_dir, tmp_path):
    precious = tmp_path / "models"
    precious.mkdir()
    (precious / "weights.bin").write_text("keep me")
    with pytest.raises(ConfigError, match="not a spec export"):
        stage.run(stage.ExportConfig(source=run_dir, format="vllm", output=precious))
    assert (precious / "weights.bin").read_text() == "keep me"


def test_refuses_a_target_of_another_shape(run_dir, tmp_path):
    from transformers import LlamaConfig

    other = tmp_path / "other-target"
    LlamaConfig(
        num_hidden_layers=N, hidden_size=64, vocab_size=V, num_attention_heads=4
    ).save_pretrained(other)
    with pytest.raises(ConfigError, match="trained for"):
        stage.run(
            stage.ExportConfig(
                source=run_dir, format="vllm", output=tmp_path / "out", target=str(other)
            )
        )
    same = tmp_path / "same-target"
    LlamaConfig(
        num_hidden_layers=N, hidden_size=HT, vocab_size=V, num_attention_heads=4
    ).save_pretrained(same)
    result = stage.run(
        stage.ExportConfig(
            source=run_dir, format="speculators", output=tmp_path / "out", target=str(same)
        )
    )
    config, _ = read(result.output)
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(same)
