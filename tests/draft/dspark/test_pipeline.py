"""DSpark through the CLI on the tiny Llama, from the DFlash pipeline's cache (the same five aux layers):
`spec train --algorithm dspark` -> resume == straight -> `spec eval` (greedy output = the target's, the
confidence head's calibration, adaptive verification) -> `spec export` for vLLM and speculators with the
keys and fields vLLM's DSpark loader reads (written from qwen3_dspark.py and algos.py update_dspark,
independently of the writer), the self-check catching what vLLM would load wrongly, `spec eval` reading an
export as vLLM does, and the bad inputs refused in one line."""

import json

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.cli import main
from spec_cli.errors import ExportCheckError
from spec_cli.export import dspark as rules
from spec_cli.export.source import load_source
from tests.draft.runs import log, tampered, weights


def train_args(pipeline, out, *extra) -> list[str]:
    root = pipeline["root"]
    return [
        "train",
        "--cache",
        str(root / "cache"),
        "-v",
        str(pipeline["vm"]),
        "--algorithm",
        "dspark",
        "--block-size",
        "3",
        "--markov-rank",
        "8",
        "--draft-layers",
        "2",
        "--lr",
        "3e-3",
        "--max-steps",
        "6",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--save-every",
        "6",
        "-o",
        str(out),
        "-q",
        *extra,
    ]


@pytest.fixture(scope="module")
def pipeline(dflash_pipeline, tmp_path_factory):
    """The DFlash pipeline's target, data and prompts; `spec precompute --algorithm dspark` of its data into
    a cache of its own (the five aux layers), and a 6-step run from it."""
    from tests.draft.runs import vocab_and_cache

    root = tmp_path_factory.mktemp("dspark")
    vm, _ = vocab_and_cache(
        root,
        dflash_pipeline["target"],
        dflash_pipeline["data"],
        96,
        "--algorithm",
        "dspark",
        "--batch-tokens",
        "512",
    )
    pipeline = {
        **dflash_pipeline,
        "root": root,
        "vm": str(vm),
        "run": root / "run",
        "dflash_run": dflash_pipeline["root"] / "run",
    }
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        assert main(train_args(pipeline, root / "run")) == 0
    finally:
        mp.undo()
    return pipeline


def test_the_checkpoint_is_a_dspark_draft_with_its_heads(pipeline):
    run = pipeline["run"]
    config = json.loads((sorted((run / "checkpoints").iterdir())[-1] / "config.json").read_text())
    target = json.loads((pipeline["target"] / "config.json").read_text())
    assert config["algorithm"] == "dspark" and config["aux_layer_ids"] == [1, 2, 3, 4, 5]
    assert config["extra"] == {
        "block_size": 3,
        "markov_rank": 8,
        "confidence_head": True,
        "confidence_with_markov": True,
    }
    state = weights(run)
    V, H = target["vocab_size"], target["hidden_size"]
    assert state["markov_head.markov_w1.weight"].shape == (V, 8)
    assert state["markov_head.markov_w2.weight"].shape == (96, 8)
    assert state["confidence_head.proj.weight"].shape == (1, H + 8)
    records = [r for r in log(run) if r["split"] == "train"]
    assert len(records[-1]["acc"]) == 3 and all(
        r["loss"] > 0 for r in records
    )  # block positions 0..2


def test_a_live_target_trains_the_numbers_of_the_cache(pipeline, tmp_path, monkeypatch):
    """The heads read nothing of the target beyond DFlash's supervision: the live target's run (fp32) logs
    the cached run's losses."""
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    args = train_args(pipeline, tmp_path / "live", "--dtype", "fp32")
    at = args.index("--cache")
    args[at : at + 2] = ["--target", str(pipeline["target"]), "--data", str(pipeline["data"])]
    assert main(args) == 0
    cached = [r["loss"] for r in log(pipeline["run"]) if r["split"] == "train"]
    assert [r["loss"] for r in log(tmp_path / "live") if r["split"] == "train"] == pytest.approx(
        cached, rel=1e-4
    )


def test_a_run_stopped_after_its_first_step_resumes_to_the_straight_runs_weights(
    pipeline, tmp_path, monkeypatch
):
    """With --max-anchors too: the anchors' draw is part of the checkpointed RNG state."""
    from spec_cli.artifacts import checkpoint as ckpt

    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    extra = ("--pack", "--max-anchors", "40")
    assert main(train_args(pipeline, tmp_path / "straight", *extra)) == 0
    assert main([*train_args(pipeline, tmp_path / "timed", *extra), "--max-time", "0.001s"]) == 0
    assert ckpt.latest_checkpoint(tmp_path / "timed").name == "step-00000001"
    assert main([*train_args(pipeline, tmp_path / "timed", *extra), "--resume"]) == 0
    want = weights(tmp_path / "straight")
    for key, value in weights(tmp_path / "timed").items():
        assert torch.equal(value, want[key]), key


def test_speculative_decoding_gives_the_targets_text_and_reports_the_confidence_head(
    pipeline, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    outs = {}
    for name, extra in (("all", []), ("adaptive", ["--adaptive-verification", "0.9"])):
        assert (
            main(
                [
                    "eval",
                    "-t",
                    str(pipeline["target"]),
                    "--draft",
                    str(pipeline["run"]),
                    "--prompts",
                    str(pipeline["prompts"]),
                    "--num-prompts",
                    "2",
                    "--max-new-tokens",
                    "12",
                    "-o",
                    str(tmp_path / name),
                    *extra,
                ]
            )
            == 0
        )  # (no --depth: the block's 3)
        outs[name] = json.loads((tmp_path / name / "eval.json").read_text())
    text = " ".join(capsys.readouterr().out.split())
    assert "confidence head, predicted vs realised acceptance by position: 1:" in text
    full, adaptive = outs["all"]["overall"], outs["adaptive"]["overall"]
    assert outs["all"]["settings"]["depth"] == 3
    assert (
        full["same_as_target"] == full["turns"] > 0
        and adaptive["same_as_target"] == adaptive["turns"]
    )
    predicted = full["predicted_acceptance"]
    assert len(predicted) == 3 and all(p is None or 0 < p < 1 for p in predicted)
    assert sum(adaptive["verified"]) < sum(full["verified"])  # fewer positions verified
    assert (
        main(
            [
                "eval",
                "-t",
                str(pipeline["target"]),
                "--draft",
                str(pipeline["run"]),
                "--prompts",
                str(pipeline["prompts"]),
                "--num-prompts",
                "1",
                "--depth",
                "4",
                "-o",
                str(tmp_path / "t"),
                "-q",
            ]
        )
        == 1
    )
    assert "--depth 3 or less" in " ".join(capsys.readouterr().err.split())


@pytest.fixture(scope="module")
def exports(pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark-exports")
    for fmt in ("vllm", "speculators"):
        assert (
            main(
                [
                    "export",
                    str(pipeline["run"]),
                    "--format",
                    fmt,
                    "--dtype",
                    "bf16",
                    "-o",
                    str(root / fmt),
                    "-q",
                ]
            )
            == 0
        )  # (the engine check: skipped, vLLM 0.32 runs DSpark in its V2 runner only)
    return root


LAYER = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_each_format_has_what_vllms_dspark_model_reads(exports, pipeline, fmt):
    tensors = load_file(str(exports / fmt / "model.safetensors"))
    heads = {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }
    want = {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        *heads,
        *(f"layers.{i}.{k}" for i in range(2) for k in LAYER),
    }
    if fmt == "speculators":
        want |= {"t2d"}
    assert set(tensors) == want
    assert (
        tensors["confidence_head.proj.weight"].dtype == torch.float32
    )  # vLLM builds the head in fp32
    assert tensors["markov_head.markov_w1.weight"].dtype == torch.bfloat16
    src = load_source(pipeline["run"])
    config = json.loads((exports / fmt / "config.json").read_text())
    readme = (exports / fmt / "README.md").read_text()
    assert '"method": "dspark"' in readme and '"num_speculative_tokens": 3' in readme
    # what vLLM reads: the heads' fields, the anchor sampling, the layers and the noise token
    assert config["markov_rank"] == 8 and config["enable_confidence_head"] is True
    assert config["confidence_head_with_markov"] is True and config["sample_from_anchor"] is True
    if fmt == "vllm":
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 3
        assert config["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
        assert config["dflash_config"]["mask_token_id"] == src.config.mask_token_id
    else:
        assert config["speculators_model_type"] == "dspark" and config[
            "aux_hidden_state_layer_ids"
        ] == [2, 3, 4, 5, 6]
        assert (
            config["mask_token_id"] == src.config.mask_token_id
            and config["markov_head_type"] == "vanilla"
        )
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    view = rules.dflash.view_of(config, fmt, rules.DSPARK)
    assert view.problems == [] and view.layer_outputs == [1, 2, 3, 4, 5] and not any(view.causal)


@pytest.mark.parametrize(
    "fmt,edit_tensors,edit_config,says",
    [
        (
            "vllm",
            lambda t: t.__setitem__(
                "markov_head.markov_w1.weight", t["markov_head.markov_w1.weight"].flip(0)
            ),
            None,
            "block offset 0",
        ),
        (
            "vllm",
            lambda t: t.pop("confidence_head.proj.bias"),
            None,
            "confidence_head.proj.bias is not in the file",
        ),
        (
            "vllm",
            lambda t: t.__setitem__(
                "confidence_head.proj.bias", t["confidence_head.proj.bias"] + 1
            ),
            None,
            "confidence at block position 0",
        ),
        (
            "vllm",
            lambda t: t.__setitem__(
                "confidence_head.proj.weight", t["confidence_head.proj.weight"].bfloat16()
            ),
            None,
            "not the torch.float32",
        ),
        ("vllm", None, lambda c: c.__setitem__("markov_rank", 4), "markov_head.markov_w1.weight"),
        (
            "vllm",
            None,
            lambda c: c.__setitem__("sample_from_anchor", False),
            "sample_from_anchor is false",
        ),
        (
            "vllm",
            None,
            lambda c: c.__setitem__("enable_confidence_head", False),
            "confidence_head is False for vLLM",
        ),
        ("speculators", None, lambda c: c.pop("sample_from_anchor"), "sample_from_anchor is false"),
        (
            "speculators",
            None,
            lambda c: c.__setitem__("markov_head_type", "rnn"),
            "vanilla head only",
        ),
        (
            "speculators",
            None,
            lambda c: c["speculators_config"]["proposal_methods"][0].__setitem__(
                "speculative_tokens", 4
            ),
            "4 speculative tokens",
        ),
    ],
)
def test_the_self_check_catches_what_vllm_would_load_wrongly(
    exports, pipeline, tmp_path, fmt, edit_tensors, edit_config, says
):
    folder = tampered(exports, tmp_path, fmt, edit_tensors, edit_config)
    with pytest.raises(ExportCheckError) as err:
        rules.check(folder, fmt, load_source(pipeline["run"]), torch.bfloat16)
    assert says in str(err.value)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_spec_eval_reads_an_export_as_vllm_does(pipeline, tmp_path, fmt, monkeypatch):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    assert (
        main(
            [
                "export",
                str(pipeline["run"]),
                "--format",
                fmt,
                "--dtype",
                "fp32",
                "-o",
                str(tmp_path / fmt),
                "-q",
            ]
        )
        == 0
    )
    outs = {}
    for name, draft in (("checkpoint", pipeline["run"]), ("export", tmp_path / fmt)):
        out = tmp_path / name
        assert (
            main(
                [
                    "eval",
                    "-t",
                    str(pipeline["target"]),
                    "--draft",
                    str(draft),
                    "--prompts",
                    str(pipeline["prompts"]),
                    "--num-prompts",
                    "2",
                    "--max-new-tokens",
                    "10",
                    "-o",
                    str(out),
                    "-q",
                ]
            )
            == 0
        )
        outs[name] = json.loads((out / "eval.json").read_text())["overall"]
    assert outs["export"]["accepted"] == outs["checkpoint"]["accepted"]
    assert outs["export"]["predicted_acceptance"] == pytest.approx(
        outs["checkpoint"]["predicted_acceptance"], abs=1e-6
    )
    assert outs["export"]["same_as_target"] == outs["export"]["turns"]


def test_a_draft_without_the_confidence_head_exports_without_it(pipeline, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    assert (
        main(train_args(pipeline, tmp_path / "run", "--no-confidence-head", "--max-steps", "2"))
        == 0
    )
    assert (
        main(["export", str(tmp_path / "run"), "--format", "vllm", "-o", str(tmp_path / "x"), "-q"])
        == 0
    )
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    assert (
        config["enable_confidence_head"] is False and config["confidence_head_with_markov"] is False
    )
    assert not any(
        k.startswith("confidence_head")
        for k in load_file(str(tmp_path / "x" / "model.safetensors"))
    )


@pytest.mark.parametrize(
    "extra,says",
    [
        (
            ["--no-confidence-head", "--confidence-weight", "0.5"],
            "--confidence-weight 0.5 without a confidence head",
        ),
        (["--loss", "lk-alpha"], "--loss lk-alpha does not apply to DSpark"),
        (["--markov-rank", "0"], "--markov-rank"),
        (["--context-parallel", "2"], "--context-parallel: DSpark does not split its rows"),
    ],
)
def test_bad_training_options_are_one_line_and_write_nothing(
    pipeline, tmp_path, monkeypatch, capsys, extra, says
):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    code = main(train_args(pipeline, tmp_path / "bad", *extra))
    err = " ".join(capsys.readouterr().err.split())
    assert code in (1, 2) and says in err and "Traceback" not in err
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_what_spec_cli_cannot_run_in_vllm_is_refused_in_one_line(
    pipeline, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    assert (
        main(
            [
                "export",
                str(pipeline["run"]),
                "--format",
                "vllm",
                "--engine-check",
                "vllm",
                "-o",
                str(tmp_path / "x"),
                "-q",
            ]
        )
        == 1
    )
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "no engine check for dspark exports here: vLLM 0.32.0 runs dspark drafts only in its V2 model runner"
        in err
    )
    assert not (tmp_path / "x").exists()
    assert (
        main(
            [
                "eval",
                "-t",
                str(pipeline["target"]),
                "--draft",
                str(pipeline["run"]),
                "--prompts",
                str(pipeline["prompts"]),
                "--engine",
                "vllm",
                "-o",
                str(tmp_path / "e"),
                "-q",
            ]
        )
        == 1
    )
    assert "cannot run DSpark drafts in vLLM here" in " ".join(capsys.readouterr().err.split())
    assert main(train_args(pipeline, tmp_path / "loop", "--eval-engine", "vllm")) == 1
    assert "--eval-engine vllm cannot run DSpark drafts here" in " ".join(
        capsys.readouterr().err.split()
    )
    assert not (tmp_path / "loop" / "checkpoints").exists()
    assert (
        main(
            [
                "eval",
                "-t",
                str(pipeline["target"]),
                "--draft",
                str(pipeline["dflash_run"]),
                "--prompts",
                str(pipeline["prompts"]),
                "--adaptive-verification",
                "0.5",
                "-o",
                str(tmp_path / "f"),
                "-q",
            ]
        )
        == 1
    )
    assert "has none" in " ".join(
        capsys.readouterr().err.split()
    )  # a DFlash draft: no confidence head
