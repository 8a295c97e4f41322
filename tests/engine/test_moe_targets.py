"""Mixture-of-experts targets through the whole pipeline, as a user runs it: tiny random Qwen3-MoE and
gpt-oss targets (sized for vLLM's CPU attention: head_dim 32) go through precompute with both target
engines (the caches equal within fp32 rounding), training, the vLLM export with its engine check, and
(gpt-oss) greedy-identical eval in PyTorch and in vLLM. One module fixture per target runs the CLI
once; the tests read what it wrote.

gpt-oss keeps its input embedding under `embedding`, not `embed_tokens`: before the fix, precompute
with --target-engine vllm ended in "internal error: AttributeError: 'GptOssModel' object has no
attribute 'embed_tokens'"."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.cli import main
from tests import tiny
from tests.engine.test_vllm import train_on_sized_target

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.slow]

FIELDS_TOL = {"aux_hidden": 1e-5, "final_hidden": 1e-4, "lse": 1e-4}  # fp32, CPU: rounding only
# `spec eval` of the export in each engine: for gpt-oss (its own embedding name, sliding layers); the
# export's engine check already decodes each target's draft in vLLM and in PyTorch and compares them
EVAL_ENGINES = {"gpt_oss": ("torch", "vllm"), "qwen3_moe": ()}


def save_moe_target(path: Path, kind: str) -> Path:
    """A tiny random MoE target with the llama3 chat tokenizer; attention and expert outputs scaled up so
    that layers differ and next-token distributions are peaked (something for a draft to learn)."""
    import transformers

    tokenizer = tiny.build_tokenizer("llama3")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **common
        )
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **common,
        )
    else:
        config = transformers.GptOssConfig(
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            **common,
        )
    path.mkdir(parents=True)
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj")) or name.endswith(
                "experts.down_proj.weight"
            ):
                p.mul_(8)
        model.lm_head.weight.mul_(40)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe(request, tmp_path_factory):
    """The pipeline on one MoE target: vocab map, precompute in transformers and in vLLM, 60 training
    steps from the transformers cache, the vLLM export with the engine check, eval in EVAL_ENGINES."""
    root = tmp_path_factory.mktemp(request.param)
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        target = save_moe_target(root / "target", request.param)
        rng = random.Random(0)
        data = root / "data.jsonl"
        data.write_text("".join(json.dumps(tiny.random_sharegpt(rng)) + "\n" for _ in range(60)))
        vm = str(root / "vm.safetensors")
        # the cache's batches are training's (512 tokens, as --batch-tokens below says)
        common = ["-t", str(target), "-d", str(data), "-v", vm, "--batch-tokens", "512", "-q"]
        assert (
            main(
                [
                    "build-vocab-map",
                    "-t",
                    str(target),
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
        assert main(["precompute", *common, "-o", str(root / "cache-hf"), "--dtype", "fp32"]) == 0
        assert (
            main(
                [
                    "precompute",
                    *common,
                    "-o",
                    str(root / "cache-vllm"),
                    "--dtype",
                    "fp32",
                    "--target-engine",
                    "vllm",
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "train",
                    "--cache",
                    str(root / "cache-hf"),
                    "-v",
                    vm,
                    "-o",
                    str(root / "run"),
                    "--lr",
                    "1e-2",
                    "--batch-tokens",
                    "512",
                    "--ttt-steps",
                    "2",
                    "--max-steps",
                    "60",
                    "-q",
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "export",
                    str(root / "run"),
                    "--format",
                    "vllm",
                    "--dtype",
                    "fp32",
                    "--engine-check",
                    "vllm",
                    "-o",
                    str(root / "export"),
                ]
            )
            == 0
        )
        evals = {}
        for engine in EVAL_ENGINES[request.param]:
            out = root / f"eval-{engine}"
            assert (
                main(
                    [
                        "eval",
                        "-t",
                        str(target),
                        "--draft",
                        str(root / "export"),
                        "--prompts",
                        str(data),
                        "--num-prompts",
                        "3",
                        "--max-new-tokens",
                        "16",
                        "--depth",
                        "2",
                        "--engine",
                        engine,
                        "--dtype",
                        "fp32",
                        "-o",
                        str(out),
                        "-q",
                    ]
                )
                == 0
            )
            evals[engine] = json.loads((out / "eval.json").read_text())
    finally:
        mp.undo()
    return {"kind": request.param, "root": root, "target": target, "evals": evals}


def _shards(cache: Path) -> dict[str, torch.Tensor]:
    """Every field of every shard of a cache, concatenated in shard order."""
    fields: dict[str, list[torch.Tensor]] = {}
    for shard in sorted(cache.glob("shard-*.safetensors")):
        for name, t in load_file(str(shard)).items():
            fields.setdefault(name, []).append(t)
    return {k: torch.cat(v) for k, v in fields.items()}


def test_both_target_engines_write_the_same_cache(moe):
    hf, vl = _shards(moe["root"] / "cache-hf"), _shards(moe["root"] / "cache-vllm")
    assert hf.keys() == vl.keys() and hf
    print(
        moe["kind"],
        {
            n: float((a.float() - vl[n].float()).abs().max())
            for n, a in hf.items()
            if a.is_floating_point()
        },
    )
    for name, a in hf.items():
        b = vl[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.is_floating_point():
            diff = float((a.float() - b.float()).abs().max())
            assert diff <= FIELDS_TOL.get(name, 1e-5), (moe["kind"], name, diff)
        else:
            assert torch.equal(a, b), (moe["kind"], name)


def test_both_engines_decode_the_export_as_the_target_does(moe):
    """(The export itself passed vLLM's engine check in the fixture: a failed check exits non-zero.)"""
    if not moe["evals"]:
        pytest.skip(f"{moe['kind']}: the export's engine check compared vLLM with PyTorch")
    for engine, report in moe["evals"].items():
        overall = report["overall"]
        print(
            moe["kind"],
            engine,
            overall["acceptance_length"],
            overall["same_as_target"],
            overall["turns"],
        )
        assert overall["same_as_target"] == overall["turns"], (moe["kind"], engine)
        assert overall["acceptance_length"] > 1.0, (
            moe["kind"],
            engine,
        )  # the draft accepts something


def test_mixtral_is_served_through_vllms_transformers_backend(tmp_path, monkeypatch, capsys):
    """vLLM 0.32's MixtralForCausalLM cannot capture aux states, so the export is refused; with
    --allow-unsupported-target it is written, vLLM's engine check runs the target under --model-impl
    transformers (and passes: the same acceptance per position as the checkpoint), the serve command
    says so, and `spec eval --engine vllm` decodes through that backend as the target does."""
    target = save_moe_target(tmp_path / "target", "mixtral")
    run = train_on_sized_target(tmp_path, "--ttt-steps", "2", "--max-steps", "60", target=target)
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    export = [
        "export",
        str(tmp_path / "run"),
        "--format",
        "vllm",
        "--dtype",
        "fp32",
        "-o",
        str(tmp_path / "export"),
    ]
    assert main(export) == 1
    assert "MixtralForCausalLM does not implement SupportsEagle3" in " ".join(
        capsys.readouterr().err.split()
    )
    assert main([*export, "--allow-unsupported-target", "--engine-check", "vllm"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    served, reference = re.search(
        r"accepted per position (\[[\d, ]+\]) vs (\[[\d, ]+\])", text
    ).groups()
    assert "passed: vLLM 0.32.0 (--model-impl transformers)" in text and served == reference
    assert json.loads(served)[0] > 0
    assert (
        f"vllm serve {target} --model-impl transformers --speculative-config"
        in (tmp_path / "export" / "README.md").read_text()
    )
    assert (
        main(
            [
                "eval",
                "-t",
                str(target),
                "--draft",
                str(tmp_path / "export"),
                "--prompts",
                str(run["data"]),
                "--num-prompts",
                "3",
                "--max-new-tokens",
                "16",
                "--depth",
                "2",
                "--engine",
                "vllm",
                "--dtype",
                "fp32",
                "-o",
                str(tmp_path / "eval"),
                "-q",
            ]
        )
        == 0
    )
    overall = json.loads((tmp_path / "eval" / "eval.json").read_text())["overall"]
    assert overall["same_as_target"] == overall["turns"] and overall["acceptance_length"] > 1.0
