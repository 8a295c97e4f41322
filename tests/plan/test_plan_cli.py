"""`spec plan` for Llama-3.1-8B and Llama-3.1-70B (their config.json written here, no download) at
T = 8k and 32k, through the CLI: the counts against independent arithmetic (published parameter
counts, the draft's layer shapes, the cache's per-token layout), the memory verdicts a user rents GPUs
by, and the errors for bad input."""

import json
from pathlib import Path

import pytest

from spec_cli.cli import main

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
    "head_dim": 128,
    "num_key_value_heads": 8,
}
SIZES = {
    "8b": dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32
    ),
    "70b": dict(
        hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_hidden_layers=80
    ),
}
PUBLISHED = {"8b": 8_030_261_248, "70b": 70_553_706_496}  # the models' safetensors index totals


def plan_of(tmp_path, size: str, *args: str) -> dict:
    folder = tmp_path / size
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA | SIZES[size]))
    out = tmp_path / f"{size}.json"
    assert (
        main(
            [
                "plan",
                str(folder / "config.json"),
                "--seq-len",
                "8192,32768",
                "--json",
                str(out),
                *args,
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def eagle3_trained(H: int, inter: int, heads: int, kv: int, d: int, vd: int) -> int:
    """fc [H, 3H], one decoder layer reading [embed; hidden] (2H in), its norms, the final norm, lm_head."""
    attention = 2 * H * heads * d + 2 * 2 * H * kv * d + heads * d * H
    return 3 * H * H + attention + 3 * H * inter + 2 * H + H + H + vd * H


@pytest.mark.parametrize("size", ["8b", "70b"])
def test_llama_plans(tmp_path, size, capsys):
    plan = plan_of(tmp_path, size, "--ttt-steps", "7")  # the deepest unroll users train
    s = SIZES[size]
    H, V = s["hidden_size"], LLAMA["vocab_size"]
    assert plan["target"]["parameters"] == PUBLISHED[size]
    assert plan["draft"]["trained_parameters"] == eagle3_trained(
        H, s["intermediate_size"], s["num_attention_heads"], 8, 128, 32000
    )
    assert plan["draft"]["frozen_parameters"] == V * H  # the target's embedding, fp32 in the draft
    # the cache's token: 3 aux states + the final hidden state in the storage dtype, ids (int32), mask
    # (uint8), argmax (int32), lse (fp32)
    per = {(c["encoding"], c["storage_dtype"]): c["bytes_per_token"] for c in plan["cache"]}
    assert (
        per["hidden", "bf16"] == 4 * H * 2 + 13 and per["probs", "fp32"] == (3 * H + 32000) * 4 + 13
    )
    steps = {(r["seq_len"], r["activation_checkpointing"]): r for r in plan["steps"]}
    # activation checkpointing trades memory for recompute, at every length
    for T in (8192, 32768):
        assert steps[T, True]["peak_gb"] < steps[T, False]["peak_gb"]
        assert steps[T, True]["flops_per_token"] > steps[T, False]["flops_per_token"]
    # causal attention makes a token dearer in longer rows
    assert steps[32768, False]["flops_per_token"] > steps[8192, False]["flops_per_token"]
    # at 32k the step needs activation checkpointing on an 80 GB GPU, and fits with it
    assert not steps[32768, False]["fits"] and steps[32768, True]["fits"]
    assert plan["target"]["placement"] == ("replica" if size == "8b" else "tensor-parallel")
    printed = capsys.readouterr().out
    assert "--activation-checkpointing brings it to" in printed


def test_the_plan_follows_spec_trains_default_unroll(tmp_path):
    """spec train's EAGLE-3 default unrolls 3 steps: the plan's default step does too, and needs
    less memory than 7 (an 8B target's 32k rows then fit an 80 GB GPU without checkpointing)."""
    plan = plan_of(tmp_path, "8b")
    assert plan["draft"]["ttt_steps"] == 3 and plan["draft"]["steps"] == "TTT 3"
    steps = {(r["seq_len"], r["activation_checkpointing"]): r for r in plan["steps"]}
    assert steps[32768, False]["fits"]


def test_plan_errors(tmp_path, capfd):
    assert main(["plan", str(tmp_path / "nowhere")]) == 1
    assert "no config.json" in capfd.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | SIZES["8b"]))
    assert main(["plan", str(tmp_path), "--ttt-steps", "0"]) == 2  # as spec train's range check
    assert "Invalid value for '--ttt-steps'" in capfd.readouterr().err
    assert main(["plan", str(tmp_path), "--algorithm", "peagle"]) == 1
    err = capfd.readouterr().err
    assert "no plan for --algorithm peagle" in err and "COD" in err
    assert main(["plan", str(tmp_path), "--gpu", "tpu"]) == 1
    assert "unknown --gpu 'tpu'" in capfd.readouterr().err
    assert main(["plan", str(tmp_path), "--target-engine", "sglang"]) == 1
    err = capfd.readouterr().err
    assert (
        "unknown --target-engine 'sglang'" in err
        and "use transformers or vllm" in err
        and "internal" not in err
    )


def test_context_parallel_plan_per_rank(tmp_path, capsys):
    """--context-parallel 8: each rank's step at 32k (Llama-3.1-8B, TTT 7) with 1/8 of the row's
    activations: far below the whole row's, enough to train without activation checkpointing on an
    80 GB GPU; the same FLOPs per token (the all-gather form adds no compute); and still above an eighth
    of the whole-row step, which the whole-row batch each rank holds and the gathered keys account for."""
    folder = tmp_path / "8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA | SIZES["8b"]))
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                str(folder),
                "--seq-len",
                "32768",
                "--context-parallel",
                "8",
                "--ttt-steps",
                "7",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    steps = {
        (r["context_parallel"], r["activation_checkpointing"]): r
        for r in json.loads(out.read_text())["steps"]
    }
    assert set(steps) == {(1, False), (1, True), (8, False), (8, True)}
    for ckpt in (False, True):
        whole, split = steps[1, ckpt], steps[8, ckpt]
        # (with checkpointing the resident part dominates: weights, AdamW state, the whole batch)
        assert whole["peak_gb"] / 8 < split["peak_gb"] < whole["peak_gb"] / (2 if not ckpt else 1.5)
        assert split["flops_per_token"] == pytest.approx(whole["flops_per_token"], rel=1e-3)
    assert not steps[1, False]["fits"] and steps[8, False]["fits"]
    printed = " ".join(capsys.readouterr().out.split())
    assert "with --context-parallel 8 each rank holds 1/8 of a row's activations" in printed
    assert main(["plan", str(folder), "--context-parallel", "3"]) == 1


# a small decoder's fields, as a Llama config.json has them
SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
}


def plan_config(tmp_path, name: str, config: dict) -> tuple[int, Path]:
    """`spec plan` on this config.json at a short row, TTT 1 (a quick plan): (exit code, the --json path)."""
    path, out = tmp_path / f"{name}.json", tmp_path / f"{name}.plan.json"
    path.write_text(json.dumps(config))
    code = main(
        [
            "plan",
            str(path),
            "--seq-len",
            "64",
            "--avg-tokens",
            "64",
            "--ttt-steps",
            "1",
            "--gpus",
            "1",
            "--json",
            str(out),
        ]
    )
    return code, out


def test_plan_unknown_model_type_says_what_it_assumes(tmp_path, capfd):
    """A model type transformers does not know, with a decoder's fields: planned as a Llama-style dense
    decoder, one warning saying so, and counted as transformers counts the same fields' Llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    code, out = plan_config(
        tmp_path,
        "frob",
        SMALL | {"model_type": "frobnicator", "architectures": ["FrobnicatorForCausalLM"]},
    )
    err = " ".join(capfd.readouterr().err.split())
    assert code == 0
    assert err == (
        "warning: model_type 'frobnicator' is not one transformers knows: planned as a Llama-style "
        "dense decoder (attention + gated MLP per layer)"
    )
    with torch.device("meta"):
        llama = LlamaForCausalLM(LlamaConfig(**SMALL))
    plan = json.loads(out.read_text())
    assert plan["target"]["parameters"] == sum(p.numel() for p in llama.parameters())
    assert plan["draft"]["trained_parameters"] == eagle3_trained(256, 512, 4, 2, 64, 1000)


@pytest.mark.parametrize(
    "config",
    [
        {
            "model_type": "mamba",
            "architectures": ["MambaForCausalLM"],
            "hidden_size": 768,
            "num_hidden_layers": 24,
            "vocab_size": 50280,
            "state_size": 16,
            "expand": 2,
            "conv_kernel": 4,
            "intermediate_size": 1536,
        },
        SMALL
        | {
            "model_type": "mamba",
            "architectures": ["MambaForCausalLM"],
        },  # heads in the file: still Mamba
        {
            "model_type": "rwkv",
            "architectures": ["RwkvForCausalLM"],
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "vocab_size": 50277,
            "attention_hidden_size": 768,
        },
    ],
    ids=["mamba", "mamba-with-heads", "rwkv"],
)
def test_plan_refuses_a_model_without_attention(tmp_path, capfd, config):
    code, out = plan_config(tmp_path, config["model_type"], config)
    err = capfd.readouterr().err
    cls = {"mamba": "MambaConfig", "rwkv": "RwkvConfig"}[config["model_type"]]
    assert code == 1 and not out.exists()
    assert err.startswith(
        f"error: model_type '{config['model_type']}' ({cls}) is a state-space or recurrent "
        "model (no attention layers), not a transformer decoder"
    )
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_attention_heads", "intermediate_size"])
def test_plan_refuses_a_config_without_a_field_it_needs(tmp_path, capfd, field):
    config = {k: v for k, v in SMALL.items() if k != field} | {"model_type": "frobnicator"}
    code, out = plan_config(tmp_path, "frob", config)
    err = capfd.readouterr().err
    assert code == 1 and not out.exists()
    assert (
        err.startswith(
            f"error: the target's config (model_type 'frobnicator') has no {field}, which spec plan "
            "needs"
        )
        and "internal" not in err
    )
    assert len(err.strip().splitlines()) == 1
