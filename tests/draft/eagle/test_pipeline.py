"""EAGLE-1/2 through the CLI on a tiny target: precompute / live / served supervision -> train ->
`spec eval` (chain and tree, greedy output = the target's) -> `spec export` for vLLM and SGLang with the
exact key sets the engines load (tables written from vLLM's llama_eagle.py and SGLang's, independent of
the writer), and the self-check catching the silent failures users would hit. (FSDP over two processes,
and a stopped run resumed: tests/test_distributed.py.)"""

import json

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.cli import main
from spec_cli.errors import ExportCheckError
from spec_cli.export.eagle import check_eagle_export
from spec_cli.export.source import load_source
from tests.draft.runs import log, tampered, weights

LAYER0 = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
]


@pytest.fixture(scope="module")
def pipeline(eagle_pipeline):
    """Vocab map, cache and a 4-step run of two draft layers (tests/conftest.py: one per test session)."""
    return eagle_pipeline


def test_the_checkpoint_holds_the_draft_and_the_run_the_targets_embedding_and_head(pipeline):
    root = pipeline["root"]
    checkpoint = sorted((root / "run" / "checkpoints").iterdir())[-1]
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["algorithm"] == "eagle" and config["aux_layer_ids"] == []
    assert "lm_head.weight" not in load_file(str(checkpoint / "model.safetensors"))
    frozen = load_file(str(root / "run" / "frozen.safetensors"))
    assert sorted(frozen) == ["embed_tokens.weight", "lm_head.weight"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(pipeline["target"]))
    torch.testing.assert_close(
        frozen["lm_head.weight"].float(), model.get_output_embeddings().weight.float()
    )
    records = [r for r in log(root / "run") if r["split"] == "train"]
    assert len(records[-1]["acc"]) == 2 and records[-1]["loss"] < records[0]["loss"] + 1.0


@pytest.mark.slow
def test_live_and_served_supervision_train_the_same_numbers_as_the_cache(
    pipeline, tmp_path, monkeypatch
):
    """A live target (also streamed: the same weights bit for bit), a server (`spec serve-target
    --algorithm eagle`: final hidden states on request) and the cache give the same supervision
    (fp32): the same logged losses."""
    from spec_cli.targets.hf_backend import HFTargetBackend
    from tests.serve.harness import start_server

    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    common = [
        "-v",
        pipeline["vm"],
        "--algorithm",
        "eagle",
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
        "--save-every",
        "4",
        "--draft-layers",
        "2",
        "--dtype",
        "fp32",
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
    backend = HFTargetBackend(
        pipeline["target"], [], device="cpu", dtype="fp32"
    )  # EAGLE-1/2: no aux layer
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


@pytest.mark.parametrize("topk", [1, 3])
def test_speculative_decoding_gives_the_targets_own_greedy_text(
    pipeline, tmp_path, topk, monkeypatch
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
                "--topk",
                str(topk),
                "-o",
                str(out),
                "-q",
            ]
        )
        == 0
    )
    overall = json.loads((out / "eval.json").read_text())["overall"]
    assert overall["same_as_target"] == overall["turns"] > 0 and sum(overall["verified"]) > 0


@pytest.fixture(scope="module")
def exports(pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-exports")
    for fmt in ("vllm", "sglang"):
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


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_each_engine_gets_exactly_the_keys_its_loader_has(exports, fmt):
    keys = set(load_file(str(exports / fmt / "model.safetensors")))
    want = {
        "fc.weight",
        *(f"layers.{i}.{k}" for i in range(2) for k in LAYER0),
        "layers.1.input_layernorm.weight",
    }
    if fmt == "sglang":  # its fc has a bias that would otherwise keep nn.Linear's random init
        want.add("fc.bias")
    assert keys == want
    config = json.loads((exports / fmt / "config.json").read_text())
    assert config["architectures"] == [
        {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}[fmt]
    ]
    assert not config["attention_bias"] and not config["bias"] and not config["tie_word_embeddings"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    readme = (exports / fmt / "README.md").read_text()
    assert (
        ('"method": "eagle"' in readme)
        if fmt == "vllm"
        else ("--speculative-algorithm EAGLE " in readme)
    )


@pytest.mark.parametrize(
    "fmt, edit_tensors, edit_config, message",
    [
        (
            "vllm",
            lambda t: t.pop("layers.0.mlp.down_proj.weight"),
            None,
            "down_proj.weight is not in the file",
        ),
        (
            "vllm",
            lambda t: t.update({"lm_head.weight": torch.zeros(400, 32)}),
            None,
            "lm_head.weight is not a parameter",
        ),
        (
            "vllm",
            lambda t: t.update({"fc.bias": torch.ones(32)}),
            None,
            "fc.bias is not a parameter",
        ),
        ("sglang", lambda t: t.update({"fc.bias": torch.ones(32)}), None, "fc.bias is not zero"),
        ("sglang", lambda t: t.pop("fc.bias"), None, "fc.bias is not in the file"),
        ("vllm", lambda t: t.update({"fc.weight": t["fc.weight"] * 1.01}), None, "logits differ"),
        ("vllm", None, lambda c: c.update({"attention_bias": True}), "biases nothing loads"),
        (
            "sglang",
            None,
            lambda c: c.update({"architectures": ["LlamaForCausalLM"]}),
            "architectures",
        ),
        ("vllm", None, lambda c: c.pop("rope_theta"), "LlamaConfig's defaults"),
    ],
)
def test_the_self_check_catches_what_the_engines_would_load_in_silence(
    exports, pipeline, tmp_path, fmt, edit_tensors, edit_config, message
):
    src = load_source(pipeline["root"] / "run")
    check_eagle_export(exports / fmt, fmt, src, torch.float32)  # the untouched export passes
    folder = tampered(exports, tmp_path, fmt, edit_tensors, edit_config)
    with pytest.raises(ExportCheckError, match=message):
        check_eagle_export(folder, fmt, src, torch.float32)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_spec_eval_reads_an_export_as_its_engine_does(
    exports, pipeline, tmp_path, fmt, monkeypatch
):
    """The export (fp32) decodes exactly as its checkpoint: same drafts accepted, same text."""
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


def test_an_eagle_draft_is_not_written_in_the_speculators_format(
    pipeline, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("SPEC_HOME", str(pipeline["root"] / "home"))
    assert (
        main(
            [
                "export",
                str(pipeline["root"] / "run"),
                "--format",
                "speculators",
                "-o",
                str(tmp_path / "x"),
                "-q",
            ]
        )
        == 1
    )
    assert "eagle drafts are not written as --format speculators" in capsys.readouterr().err
