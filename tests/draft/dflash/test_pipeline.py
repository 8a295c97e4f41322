"""DFlash through the CLI on a tiny target: precompute (five aux layers) -> `spec train --algorithm dflash`
-> `spec eval` (greedy output = the target's, one draft forward per cycle) -> `spec export` for vLLM and
speculators with the keys and config fields vLLM's DFlash model reads (written from qwen3_dflash.py and
algos.py update_dflash, independently of the writer), the self-check catching what vLLM would load
wrongly, and `spec eval` reading an export as vLLM does."""

import json

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.cli import main
from spec_cli.errors import ExportCheckError
from spec_cli.export import dflash as rules
from spec_cli.export.source import load_source
from tests.draft.runs import dflash_train_args, log, tampered, weights

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


@pytest.fixture(scope="module")
def pipeline(dflash_pipeline):
    return dflash_pipeline


def test_the_checkpoint_is_a_dflash_draft_with_its_block(pipeline):
    run = pipeline["root"] / "run"
    config = json.loads((sorted((run / "checkpoints").iterdir())[-1] / "config.json").read_text())
    target = json.loads((pipeline["target"] / "config.json").read_text())
    assert config["algorithm"] == "dflash" and config["extra"] == {"block_size": 4}
    assert config["aux_layer_ids"] == [
        1,
        2,
        3,
        4,
        5,
    ]  # evenly from 1 to n - 3 for the 8-layer target
    assert config["num_hidden_layers"] == 2 and config["mask_token_id"] is not None
    state = weights(run)
    assert state["fc.weight"].shape == (target["hidden_size"], 5 * target["hidden_size"])
    assert {"hidden_norm.weight", "layers.1.self_attn.q_norm.weight"} <= set(state)
    records = [r for r in log(run) if r["split"] == "train"]
    assert len(records[-1]["acc"]) == 3 and all(
        r["loss"] > 0 for r in records
    )  # block offsets 1..3
    assert json.loads((run / "run.json").read_text())["options"]["block_size"] == 4


def test_the_block_size_is_checked_on_resume_and_when_out_of_range(
    pipeline, tmp_path, monkeypatch, capsys
):
    import shutil

    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    args = dflash_train_args(pipeline["root"], pipeline["vm"], tmp_path / "x")
    args[args.index("--block-size") + 1] = "1"
    assert main(args) == 2
    assert "--block-size" in capsys.readouterr().err
    shutil.copytree(pipeline["root"] / "run", tmp_path / "run")
    args = dflash_train_args(pipeline["root"], pipeline["vm"], tmp_path / "run", "--resume")
    args[args.index("--block-size") + 1] = "8"
    args[args.index("--max-steps") + 1] = "6"
    assert main(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "--resume with a different block-size: the run used 4, now 8" in err


def test_a_run_stopped_after_its_first_step_resumes_to_the_straight_runs_weights(
    pipeline, tmp_path, monkeypatch
):
    from spec_cli.artifacts import checkpoint as ckpt

    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    args = dflash_train_args(pipeline["root"], pipeline["vm"], tmp_path / "timed", "--pack")
    straight = dflash_train_args(pipeline["root"], pipeline["vm"], tmp_path / "straight", "--pack")
    assert main(straight) == 0
    assert main([*args, "--max-time", "0.001s"]) == 0
    assert ckpt.latest_checkpoint(tmp_path / "timed").name == "step-00000001"
    assert main([*args, "--resume"]) == 0
    assert ckpt.latest_checkpoint(tmp_path / "timed").name == "step-00000004"
    want = weights(tmp_path / "straight")
    for key, value in weights(tmp_path / "timed").items():
        assert torch.equal(value, want[key]), key


@pytest.mark.slow
def test_live_streamed_and_served_supervision_train_the_same_numbers_as_the_cache(
    pipeline, tmp_path, monkeypatch
):
    """The five aux layers from a live target, its stream and `spec serve-target` train what the cache does."""
    from spec_cli.targets.hf_backend import HFTargetBackend
    from tests.serve.harness import start_server

    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    common = dflash_train_args(
        pipeline["root"], pipeline["vm"], tmp_path / "unused", "--dtype", "fp32"
    )
    common = common[common.index("-v") :]
    common = [a for i, a in enumerate(common) if a != "-o" and (i == 0 or common[i - 1] != "-o")]
    source = ["--target", str(pipeline["target"]), "--data", str(pipeline["data"])]
    assert main(["train", *source, "-o", str(tmp_path / "live"), *common]) == 0
    assert main(["train", *source, "--stream", "-o", str(tmp_path / "streamed"), *common]) == 0
    assert all(
        torch.equal(v, weights(tmp_path / "live")[k])
        for k, v in weights(tmp_path / "streamed").items()
    )
    backend = HFTargetBackend(pipeline["target"], [1, 2, 3, 4, 5], device="cpu", dtype="fp32")
    handle = start_server(backend, pipeline["target"])
    try:
        assert (
            main(
                [
                    "train",
                    "--remote",
                    handle.url,
                    "--data",
                    str(pipeline["data"]),
                    "-o",
                    str(tmp_path / "served"),
                    *common,
                ]
            )
            == 0
        )
    finally:
        handle.stop(grace=5)
        backend.close()
    cached = [r["loss"] for r in log(pipeline["root"] / "run") if r["split"] == "train"]
    live = [r["loss"] for r in log(tmp_path / "live") if r["split"] == "train"]
    served = [r["loss"] for r in log(tmp_path / "served") if r["split"] == "train"]
    assert live == pytest.approx(cached, rel=1e-4)
    assert served == pytest.approx(live, rel=1e-5)


def test_speculative_decoding_gives_the_targets_own_greedy_text(
    pipeline, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "-t",
                str(pipeline["target"]),
                "--draft",
                str(pipeline["root"] / "run"),
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
    )  # (no --depth: the block's 4 - 1)
    assert json.loads((out / "eval.json").read_text())["settings"]["depth"] == 3
    overall = json.loads((out / "eval.json").read_text())["overall"]
    assert overall["same_as_target"] == overall["turns"] > 0 and sum(overall["verified"]) > 0
    assert overall["draft_ms_per_cycle"] > 0
    assert (
        main(
            [
                "eval",
                "-t",
                str(pipeline["target"]),
                "--draft",
                str(pipeline["root"] / "run"),
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
    root = tmp_path_factory.mktemp("dflash-exports")
    for fmt in ("vllm", "speculators"):
        assert (
            main(
                [
                    "export",
                    str(pipeline["root"] / "run"),
                    "--format",
                    fmt,
                    "--dtype",
                    "fp32",
                    "--engine-check",
                    "none",
                    "-o",
                    str(root / fmt),
                    "-q",
                ]
            )
            == 0
        )
    return root


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_each_format_has_what_vllms_dflash_model_reads(exports, pipeline, fmt):
    tensors = load_file(str(exports / fmt / "model.safetensors"))
    want = {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        *(f"layers.{i}.{k}" for i in range(2) for k in LAYER),
    }
    if fmt == "speculators":
        want |= {"t2d"}
    assert (
        set(tensors) == want
    )  # never embed_tokens (shared with the target) or mask_hidden (a load error)
    src = load_source(pipeline["root"] / "run")
    config = json.loads((exports / fmt / "config.json").read_text())
    readme = (exports / fmt / "README.md").read_text()
    assert '"method": "dflash"' in readme and '"num_speculative_tokens": 3' in readme
    if fmt == "vllm":
        assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
        assert config["dflash_config"] == {
            "target_layer_ids": [1, 2, 3, 4, 5],
            "mask_token_id": src.config.mask_token_id,
            "causal": False,
        }
    else:  # vLLM's update_dflash: ids - 1 -> target_layer_ids, causal = not sliding_window_non_causal
        assert config["speculators_model_type"] == "dflash" and config[
            "aux_hidden_state_layer_ids"
        ] == [2, 3, 4, 5, 6]
        assert config["sliding_window_non_causal"] is True
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    view = rules.view_of(config, fmt)
    assert view.problems == [] and view.layer_outputs == [1, 2, 3, 4, 5] and not any(view.causal)


def _swap_fc_blocks(t):
    H = t["fc.weight"].shape[0]
    blocks = list(t["fc.weight"].split(t["fc.weight"].shape[1] // 5, dim=1))
    blocks[0], blocks[1] = blocks[1], blocks[0]
    t["fc.weight"] = torch.cat(blocks, dim=1)
    assert t["fc.weight"].shape[0] == H


@pytest.mark.parametrize(
    "fmt,edit_tensors,edit_config,says",
    [
        ("vllm", _swap_fc_blocks, None, "block offset 1"),
        (
            "vllm",
            lambda t: t.pop("layers.1.self_attn.k_norm.weight"),
            None,
            "k_norm.weight is not in the file",
        ),
        ("vllm", lambda t: t.__setitem__("mask_hidden", torch.zeros(4)), None, "mask_hidden"),
        (
            "vllm",
            lambda t: t.__setitem__("d2t", torch.zeros_like(t["d2t"])),
            None,
            "wrong target ids",
        ),
        ("vllm", None, lambda c: c["dflash_config"].__setitem__("causal", True), "causally"),
        (
            "vllm",
            None,
            lambda c: c["dflash_config"].__setitem__("target_layer_ids", [1, 2, 3, 4, 6]),
            "outputs of layers",
        ),
        ("vllm", None, lambda c: c["dflash_config"].pop("mask_token_id"), "mask token"),
        (
            "speculators",
            None,
            lambda c: [
                c["transformer_layer_config"].pop(k) for k in ("rope_parameters", "rope_theta")
            ],
            "rope_theta is 1000000.0 for vLLM",
        ),
        (
            "vllm",
            None,
            lambda c: c["dflash_config"].__setitem__("target_layer_ids", [1, 2, 2, 4, 5]),
            "repeat a layer",
        ),
        (
            "speculators",
            None,
            lambda c: c.__setitem__("sliding_window_non_causal", False),
            "causally",
        ),
        (
            "speculators",
            None,
            lambda c: c["speculators_config"]["proposal_methods"][0].__setitem__(
                "speculative_tokens", 7
            ),
            "7 speculative tokens",
        ),
    ],
)
def test_the_self_check_catches_what_vllm_would_load_wrongly(
    exports, pipeline, tmp_path, fmt, edit_tensors, edit_config, says
):
    folder = tampered(exports, tmp_path, fmt, edit_tensors, edit_config)
    src = load_source(pipeline["root"] / "run")
    with pytest.raises(ExportCheckError) as err:
        rules.check(folder, fmt, src, torch.float32)
    assert says in str(err.value)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_spec_eval_reads_an_export_as_vllm_does(exports, pipeline, tmp_path, fmt, monkeypatch):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    outs = {}
    for name, draft in (("checkpoint", pipeline["root"] / "run"), ("export", exports / fmt)):
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
                    "--depth",
                    "3",
                    "-o",
                    str(out),
                    "-q",
                ]
            )
            == 0
        )
        outs[name] = json.loads((out / "eval.json").read_text())["overall"]
    assert outs["export"]["accepted"] == outs["checkpoint"]["accepted"]
    assert outs["export"]["verified"] == outs["checkpoint"]["verified"]
    assert outs["export"]["same_as_target"] == outs["export"]["turns"]
