"""P-EAGLE through the CLI on a tiny target: precompute -> `spec train --algorithm peagle` (segments) ->
`spec eval` (greedy output = the target's) -> `spec export` for vLLM and speculators with the keys and
config fields vLLM's parallel drafting reads (written from llama_eagle3.py / llm_base_proposer.py /
algos.py update_peagle, independent of the writer), the self-check catching what vLLM would load
wrongly, the other supervision sources, and vLLM itself serving the export (tests/engine). DDP, FSDP2
and a stopped run resumed: tests/test_distributed.py."""

import json

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.cli import main
from spec_cli.errors import ExportCheckError
from spec_cli.export.check import check_export
from spec_cli.export.source import load_source
from tests.draft.runs import log, tampered, weights
from tests.draft.runs import peagle_train_args as _train_args

LAYER0 = [
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


@pytest.fixture(scope="module")
def pipeline(peagle_pipeline):
    """Vocab map, cache and a 4-step run of two segments (tests/conftest.py: one per test session)."""
    return peagle_pipeline


def test_the_checkpoint_is_a_peagle_draft_with_its_mask_state(pipeline):
    run = pipeline["root"] / "run"
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    config = json.loads((checkpoint / "config.json").read_text())
    target = json.loads((pipeline["target"] / "config.json").read_text())
    assert config["algorithm"] == "peagle" and len(config["aux_layer_ids"]) == 3
    # the target's pad token, else its eos token, stands in the mask slots
    want = target.get("pad_token_id")
    want = want if want is not None else target["eos_token_id"]
    assert config["mask_token_id"] == (want[0] if isinstance(want, list) else want)
    state = weights(run)
    assert state["mask_hidden.weight"].shape == (1, 1, 3 * target["hidden_size"])
    records = [r for r in log(run) if r["split"] == "train"]
    assert len(records[-1]["acc"]) == 4 and all(r["loss"] > 0 for r in records)
    assert json.loads((run / "run.json").read_text())["options"]["peagle_segments"] == 2


def test_segments_do_not_change_the_training_numbers(pipeline, tmp_path, monkeypatch):
    """The same run with one segment per batch: the same losses (COD draws once per batch either way)."""
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    assert main(_train_args(pipeline["root"], pipeline["vm"], tmp_path / "one")) == 0
    two = [r["loss"] for r in log(pipeline["root"] / "run") if r["split"] == "train"]
    one = [r["loss"] for r in log(tmp_path / "one") if r["split"] == "train"]
    assert one == pytest.approx(two, rel=1e-5)
    norms = [
        [r["grad_norm"] for r in log(run) if r["split"] == "train"]
        for run in (tmp_path / "one", pipeline["root"] / "run")
    ]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)  # the step's gradient itself, before Adam
    # (gradients equal to fp32 rounding, tests/draft/peagle/test_objective.py; where one is tiny, Adam's
    # division by its RMS shows that rounding: up to ~1e-5 after 4 steps at lr 3e-3, 0.4% of one step)
    for key, value in weights(tmp_path / "one").items():
        torch.testing.assert_close(
            value, weights(pipeline["root"] / "run")[key], rtol=1e-4, atol=3e-5
        )


@pytest.mark.slow
def test_live_streamed_and_served_supervision_train_the_same_numbers_as_the_cache(
    pipeline, tmp_path, monkeypatch
):
    from spec_cli.targets.hf_backend import HFTargetBackend
    from tests.serve.harness import start_server

    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    common = [
        "-v",
        pipeline["vm"],
        "--algorithm",
        "peagle",
        "--ttt-steps",
        "4",
        "--max-steps",
        "4",
        "--lr",
        "3e-3",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--save-every",
        "4",
        "--dtype",
        "fp32",
        "--peagle-segments",
        "2",
        "-q",
    ]
    assert (
        main(
            [
                "train",
                "--target",
                str(pipeline["target"]),
                "--data",
                str(pipeline["data"]),
                "-o",
                str(tmp_path / "live"),
                *common,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--target",
                str(pipeline["target"]),
                "--data",
                str(pipeline["data"]),
                "--stream",
                "-o",
                str(tmp_path / "streamed"),
                *common,
            ]
        )
        == 0
    )
    assert all(
        torch.equal(v, weights(tmp_path / "live")[k])
        for k, v in weights(tmp_path / "streamed").items()
    )
    aux = json.loads(
        (
            sorted((pipeline["root"] / "run" / "checkpoints").iterdir())[-1] / "config.json"
        ).read_text()
    )["aux_layer_ids"]
    backend = HFTargetBackend(pipeline["target"], aux, device="cpu", dtype="fp32")
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


@pytest.mark.slow
def test_context_parallelism_trains_what_one_process_trains(pipeline, tmp_path, monkeypatch):
    """torchrun x2, --context-parallel 2: each rank runs its anchors' rollouts against the whole rows'
    depth-0 keys and keeps the COD elements one process keeps (whole rows sampled from the same seed), from
    the cache (rows, packed, FSDP2 over the group) and from a live target run once per group; weights and logged losses equal
    one process's, and the evaluation too (every valid element); a run stopped after its first step and
    resumed under the group equals the straight one bit for bit."""
    from tests.draft.runs import context_parallel_equals_one_process
    from tests.test_distributed import stopped_then_resumed

    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    common = [
        "-v",
        pipeline["vm"],
        "--algorithm",
        "peagle",
        "--ttt-steps",
        "4",
        "--max-steps",
        "3",
        "--lr",
        "3e-3",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--eval-every",
        "3",
        "--save-every",
        "3",
        "--precision",
        "fp32",
        "-q",
    ]
    cache = ["--cache", str(pipeline["root"] / "cache")]
    runs = {
        "cache": cache,
        "packed": [*cache, "--pack"],
        "fsdp": [*cache, "--fsdp"],
        "live": [
            "--target",
            str(pipeline["target"]),
            "--data",
            str(pipeline["data"]),
            "--dtype",
            "fp32",
        ],
    }
    # stopped after its first step and resumed under the group (in the same launch, checked below)
    stopped = ["train", *cache, "-o", str(tmp_path / "stopped"), "--context-parallel", "2", *common]
    stop_resume = [[*stopped, "--max-time", "0.001s", "--save-every", "1"], [*stopped, "--resume"]]
    # (the same losses and gradient norms to 1e-7; the depth-0 keys' gradients are summed from each depth's
    # grid and the gathered rows, so Adam shows their rounding in k_proj up to ~2e-5, 0.6% of one step)
    context_parallel_equals_one_process(runs, common, tmp_path, atol=5e-5, also=stop_resume)
    for name in runs:
        one, cp = (
            [r for r in log(tmp_path / f"{kind}-{name}") if r["split"] == "eval"]
            for kind in ("one", "cp")
        )
        assert one and cp[-1]["loss"] == pytest.approx(one[-1]["loss"], rel=1e-5)
        assert cp[-1]["acc"] == pytest.approx(one[-1]["acc"], abs=1e-12)
    # the stopped and resumed run equals the straight one: the COD seeds come from the restored RNG
    stopped_then_resumed(tmp_path / "stopped")
    straight = weights(tmp_path / "cp-cache")
    assert all(torch.equal(v, straight[k]) for k, v in weights(tmp_path / "stopped").items())


def test_segments_are_refused_under_context_parallelism():
    from spec_cli.draft.context import Context
    from spec_cli.draft.peagle.objective import PEagleObjective
    from spec_cli.errors import ConfigError
    from spec_cli.train_options import ObjectiveOptions
    from tests.draft.peagle.test_objective import peagle_draft

    objective = PEagleObjective(peagle_draft(), ObjectiveOptions(ttt_steps=3, peagle_segments=2))
    with pytest.raises(ConfigError, match="--peagle-segments 2 with --context-parallel 2") as error:
        objective.context = Context(2, 0)
    assert "drop --peagle-segments" in error.value.hint
    objective.context = None  # (no group: nothing to refuse)
    assert objective.context is None


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
                "8",
                "--depth",
                "4",
                "-o",
                str(out),
                "-q",
            ]
        )
        == 0
    )
    overall = json.loads((out / "eval.json").read_text())["overall"]
    assert overall["same_as_target"] == overall["turns"] > 0 and sum(overall["verified"]) > 0
    assert overall["draft_ms_per_cycle"] > 0 and 0 < overall["draft_share"] < 1
    records = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert all(0 < r["draft_seconds"] < r["spec_seconds"] for r in records)
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
                "--topk",
                "3",
                "-o",
                str(tmp_path / "t"),
                "-q",
            ]
        )
        == 1
    )
    assert "--topk 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def exports(pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("peagle-exports")
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
def test_each_format_has_what_parallel_drafting_reads(exports, pipeline, fmt):
    tensors = load_file(str(exports / fmt / "model.safetensors"))
    first = "midlayer." if fmt == "vllm" else "layers.0."
    want = {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "mask_hidden",
        *(first + k for k in LAYER0),
    }
    if fmt == "speculators":
        want |= {"t2d", "embed_tokens.weight"}
    assert set(tensors) == want
    target = json.loads((pipeline["target"] / "config.json").read_text())
    assert tensors["mask_hidden"].shape == (1, 1, 3 * target["hidden_size"])  # vLLM: view(1, -1)
    src = load_source(pipeline["root"] / "run")
    config = json.loads((exports / fmt / "config.json").read_text())
    assert config["mask_token_id"] == src.config.mask_token_id
    readme = (exports / fmt / "README.md").read_text()
    assert (
        "## Parallel drafting" in readme
        and f"token {src.config.mask_token_id} standing in" in readme
    )
    assert (
        "P-EAGLE drafts are served by vLLM 0.32-0.33 (its V1 model runner); not by vLLM 0.34"
        in readme
    )
    if fmt == "vllm":
        assert config["architectures"] == ["Eagle3LlamaForCausalLM"]
        assert '"method": "eagle3"' in readme and '"parallel_drafting": true' in readme
    else:  # vLLM's update_peagle: method eagle3 + parallel_drafting, mask_token_id -> pard_token
        assert config["speculators_model_type"] == "peagle"
        assert config["speculators_config"]["algorithm"] == "peagle"


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_an_installed_vllm_034_refuses_the_export_with_the_releases_that_serve_it(
    pipeline, tmp_path, capsys, monkeypatch, fmt
):
    from spec_cli.engine import vllm

    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    monkeypatch.setenv("SPEC_ENGINE_CHECK", "auto")  # (the tests' default is none)
    monkeypatch.setattr(vllm, "available", lambda: True)
    monkeypatch.setattr(vllm, "version", lambda: "0.34.0")
    assert (
        main(
            [
                "export",
                str(pipeline["root"] / "run"),
                "--format",
                fmt,
                "-o",
                str(tmp_path / "x"),
                "-q",
            ]
        )
        == 1
    )
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "the installed vLLM cannot serve P-EAGLE drafts: vLLM 0.34.0 does not serve eagle3 drafts with "
        "parallel_drafting: 0.34 removed them along with its V1 model runner"
    ) in err
    assert (
        "install vllm>=0.32,<0.34" in err
        and "--engine-check none" in err
        and "Traceback" not in err
    )
    assert not (tmp_path / "x").exists()


def test_vllm_034_in_the_loop_eval_and_tune_is_refused_before_anything_runs(
    pipeline, tmp_path, capsys, monkeypatch
):
    from spec_cli.engine import vllm

    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    monkeypatch.setattr(vllm, "available", lambda: True)
    monkeypatch.setattr(vllm, "version", lambda: "0.34.0")
    removed = "vLLM 0.34.0 does not serve eagle3 drafts with parallel_drafting"
    assert (
        main(
            [
                *_train_args(pipeline["root"], pipeline["vm"], tmp_path / "loop"),
                "--eval-engine",
                "vllm",
            ]
        )
        == 1
    )
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"--eval-engine vllm cannot run P-EAGLE drafts here: {removed}" in err
        and "install vllm>=0.32,<0.34" in err
    )
    assert not (tmp_path / "loop" / "checkpoints").exists()
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
                "--engine",
                "vllm",
                "-o",
                str(tmp_path / "e"),
                "-q",
            ]
        )
        == 1
    )
    assert f"spec eval cannot run P-EAGLE drafts in vLLM here: {removed}" in " ".join(
        capsys.readouterr().err.split()
    )


def test_training_says_which_engines_serve_the_draft(pipeline, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    args = [a for a in _train_args(pipeline["root"], pipeline["vm"], tmp_path / "run") if a != "-q"]
    assert main([*args, "--max-steps", "1", "--save-every", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "P-EAGLE drafts are served by vLLM 0.32-0.33 (its V1 model runner); not by vLLM 0.34 (it removed its "
        "V1 model runner, and them with it) nor by SGLang"
    ) in out
    assert out.index("served by") < out.index("step 1/1")  # at its start


def test_sglang_is_refused_with_the_reason(pipeline, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    assert (
        main(
            [
                "export",
                str(pipeline["root"] / "run"),
                "--format",
                "sglang",
                "-o",
                str(tmp_path / "x"),
                "-q",
            ]
        )
        == 1
    )
    assert (
        "peagle drafts are not written as --format sglang; use one of vllm, speculators"
        in " ".join(capsys.readouterr().err.split())
    )
    assert not (tmp_path / "x").exists()


def _swap_mask_chunks(t):
    m = t["mask_hidden"].reshape(3, -1)
    t["mask_hidden"] = torch.cat([m[1], m[0], m[2]]).view(1, 1, -1)


@pytest.mark.parametrize(
    "fmt, edit_tensors, edit_config, message",
    [
        ("vllm", lambda t: t.pop("mask_hidden"), None, "mask_hidden is not in the file"),
        ("vllm", _swap_mask_chunks, None, "predictions differ"),
        (
            "vllm",
            lambda t: t.update({"mask_hidden": t["mask_hidden"] * 1.5}),
            None,
            "predictions differ",
        ),
        (
            "vllm",
            None,
            lambda c: c.update({"mask_token_id": c["mask_token_id"] + 1}),
            "mask_token_id",
        ),
        ("speculators", None, lambda c: c.pop("mask_token_id"), "without mask_token_id"),
    ],
)
def test_the_self_check_catches_what_vllm_would_load_wrongly(
    exports, pipeline, tmp_path, fmt, edit_tensors, edit_config, message
):
    src = load_source(pipeline["root"] / "run")
    check_export(exports / fmt, fmt, src, torch.float32)  # the untouched export passes
    folder = tampered(exports, tmp_path, fmt, edit_tensors, edit_config)
    with pytest.raises(ExportCheckError, match=message):
        check_export(folder, fmt, src, torch.float32)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_spec_eval_reads_an_export_as_its_engine_does(
    exports, pipeline, tmp_path, fmt, monkeypatch
):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    results = []
    for name, draft in (("run", pipeline["root"] / "run"), ("export", exports / fmt)):
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
                    "8",
                    "--depth",
                    "3",
                    "-o",
                    str(tmp_path / name),
                    "-q",
                ]
            )
            == 0
        )
        results.append(json.loads((tmp_path / name / "eval.json").read_text())["overall"])
    assert (
        results[0]["accepted"] == results[1]["accepted"]
        and results[0]["verified"] == results[1]["verified"]
    )
