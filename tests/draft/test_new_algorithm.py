"""A new draft algorithm is its own package plus one line in ALGORITHMS: NORM-EAGLE (tests/draft/
norm_eagle/, which exists only in the tests) is added to the mapping here and nowhere else, and goes
through build-vocab-map -> precompute -> train -> export -> eval on the CLI. Each of its declarations is
checked where the rest of spec_cli reads it: its aux-layer count and defaults (precompute, train),
its own option (train's flags, range, run.json, the objective), its own supervision need (the cache
stores the field; training receives exactly those values), its own export format (written, checked
and read back by its own rule), and the draft an export serves (eval decodes as from the checkpoint)."""

import dataclasses
import json
import random

import pytest
import torch
from safetensors import safe_open

from spec_cli.cli import main
from spec_cli.draft import algorithms
from tests import tiny
from tests.conftest import write_jsonl
from tests.draft.norm_eagle import NORM_EAGLE
from tests.draft.norm_eagle import implementation as norm_code

N_LAYERS = 8  # tests.tiny's target
pytestmark = pytest.mark.slow


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(algorithms.ALGORITHMS, NORM_EAGLE.name, NORM_EAGLE)  # the one line
    norm_code.SEEN.clear()


def _cache_norms(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored hidden_norm, the norm of the stored final hidden states) over every cached token."""
    stored, computed = [], []
    for shard in sorted(cache.glob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            stored.append(f.get_tensor("extra.hidden_norm")[:, 0].float())
            computed.append(f.get_tensor("final_hidden").float().norm(dim=-1))
    return torch.cat(stored), torch.cat(computed)


def test_an_algorithm_in_its_own_package_runs_the_whole_pipeline(
    registered, tiny_llama_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    rng = random.Random(3)
    data = write_jsonl(tmp_path / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(12)])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [tiny.random_sharegpt(rng) for _ in range(2)])
    t, vm, cache = str(tiny_llama_dir), str(tmp_path / "vm.safetensors"), tmp_path / "cache"
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                t,
                "-d",
                str(data),
                "--draft-vocab-size",
                "64",
                "-o",
                vm,
                "-q",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "precompute",
                "-t",
                t,
                "-d",
                str(data),
                "-v",
                vm,
                "-o",
                str(cache),
                "--algorithm",
                "norm-eagle",
                "--batch-tokens",
                "512",
                "-q",
            ]
        )
        == 0
    )

    # precompute: the algorithm's aux layers, and its own per-token field, computed from the target
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["aux_layers"] == [1, N_LAYERS - 3] and manifest["extra_fields"] == {
        "hidden_norm": 1
    }
    stored, computed = _cache_norms(cache)
    assert stored.numel() == manifest["num_tokens"] > 0
    torch.testing.assert_close(stored, computed, rtol=1e-5, atol=1e-5)

    # train: its option is a flag (with its range), recorded in run.json, read by its objective
    assert main(["train", "--help"]) == 0
    assert "--norm-weight" in capsys.readouterr().out
    train = [
        "train",
        "--cache",
        str(cache),
        "-v",
        vm,
        "--ttt-steps",
        "2",
        "--max-steps",
        "3",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0",
        "--save-every",
        "3",
        "-q",
    ]
    assert (
        main(
            [
                *train,
                "--algorithm",
                "norm-eagle",
                "--norm-weight",
                "-1",
                "-o",
                str(tmp_path / "bad"),
            ]
        )
        == 1
    )
    assert "--norm-weight -1 is out of range" in capsys.readouterr().err
    assert (
        main([*train, "-o", str(tmp_path / "wrong")]) == 1
    )  # the default algorithm reads three layers
    err = capsys.readouterr().err
    assert (
        "the feature cache holds 2 aux layers [1, 5]; eagle3 reads 3" in err
        and "--algorithm eagle3" in err
    )
    run = tmp_path / "run"
    assert main([*train, "--algorithm", "norm-eagle", "--norm-weight", "0.25", "-o", str(run)]) == 0
    assert json.loads((run / "run.json").read_text())["options"]["norm_weight"] == 0.25
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["algorithm"] == "norm-eagle" and config["aux_layer_ids"] == [1, N_LAYERS - 3]
    # every batch the objective saw carried the cache's own hidden_norm values (real positions)
    assert len(norm_code.SEEN) == 3
    for seen in norm_code.SEEN:
        assert bool(
            torch.isclose(seen[:, None].float(), stored[None], rtol=0, atol=1e-6).any(1).all()
        )

    # export: its own format, written and checked by its own rule; the engines' formats refused
    out = tmp_path / "plain"
    assert main(["export", str(run), "--format", "vllm", "-o", str(tmp_path / "x"), "-q"]) == 1
    assert (
        "norm-eagle drafts are not written as --format vllm; use one of plain"
        in capsys.readouterr().err
    )
    assert (
        main(["export", str(run), "--format", "plain", "--dtype", "fp32", "-o", str(out), "-q"])
        == 0
    )
    assert json.loads((out / "config.json").read_text())["architectures"] == ["NormEagleDraft"]
    assert "no serving engine reads the plain format" in (out / "README.md").read_text()

    # eval: the export, read by its rule, decodes exactly as the checkpoint does
    results = {}
    for name, draft in (("run", run), ("export", out)):
        assert (
            main(
                [
                    "eval",
                    "-t",
                    t,
                    "--draft",
                    str(draft),
                    "--prompts",
                    str(prompts),
                    "--num-prompts",
                    "2",
                    "--max-new-tokens",
                    "6",
                    "-o",
                    str(tmp_path / f"eval-{name}"),
                    "-q",
                ]
            )
            == 0
        )
        results[name] = json.loads((tmp_path / f"eval-{name}" / "eval.json").read_text())["overall"]
    assert (
        results["run"]["same_as_target"] == results["run"]["turns"] > 0
    )  # greedy: the target's own text
    assert (
        sum(results["run"]["verified"]) > 0
    )  # the two-aux draft proposed tokens and the target checked them
    assert results["export"]["accepted"] == results["run"]["accepted"]
    assert results["export"]["verified"] == results["run"]["verified"]

    # its reading rule refuses a folder that lost a weight
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != "fc.weight"}
    from safetensors.torch import save_file

    save_file(kept, str(out / "model.safetensors"))
    assert (
        main(
            [
                "eval",
                "-t",
                t,
                "--draft",
                str(out),
                "--prompts",
                str(prompts),
                "--num-prompts",
                "1",
                "-o",
                str(tmp_path / "eval-broken"),
                "-q",
            ]
        )
        == 1
    )
    assert "is not a complete plain export: fc.weight is missing" in capsys.readouterr().err

    # an algorithm with no format at all is told so
    monkeypatch.setitem(
        algorithms.ALGORITHMS, NORM_EAGLE.name, dataclasses.replace(NORM_EAGLE, formats=())
    )
    assert main(["export", str(run), "--format", "vllm", "-o", str(tmp_path / "y"), "-q"]) == 1
    assert "spec export writes no engine format for norm-eagle yet" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    torch.manual_seed(0)  # (the CLI seeded the global generator; leave it as other tests expect)
