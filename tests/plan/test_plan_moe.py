"""`spec plan` for mixture-of-experts targets (their config.json written here, no download): Qwen3-30B-A3B,
Qwen3-235B-A22B, gpt-oss-20b and -120b (MXFP4 experts) and a DeepSeek-V3-style MLA target (FP8). Each
plan's total and active parameters, the stored weights' size and the per-GPU memory of a live target
(a replica, and sharded over the node) are checked against counts computed here from the config by
hand, and against the publishers' figures where they state them."""

import json

import pytest

from spec_cli.cli import main

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "num_experts_per_tok": 8,
    "num_experts": 128,
}
QWEN3_SIZES = {
    "30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_attention_heads=32,
        num_hidden_layers=48,
    ),
    "235b-a22b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_attention_heads=64,
        num_hidden_layers=94,
    ),
}
GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 201088,
    "experts_per_token": 4,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}
GPT_OSS_SIZES = {
    "20b": dict(num_hidden_layers=24, num_local_experts=32),
    "120b": dict(num_hidden_layers=36, num_local_experts=128),
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}


def plan_of(tmp_path, name: str, config: dict, *args: str) -> dict:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / f"{name}.json"
    # (TTT 1: the draft's step is not what these tests check, and a shallower one is measured sooner)
    assert (
        main(
            [
                "plan",
                str(folder / "config.json"),
                "--seq-len",
                "8192",
                "--ttt-steps",
                "1",
                "--json",
                str(out),
                *args,
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def qwen3_moe_count(c: dict) -> tuple[int, int, int]:
    """(total, active, routed-expert parameters) by hand: GQA attention with per-head q/k norms, a router
    and E SwiGLU experts per layer, two norms a layer, untied embedding and head, the final norm."""
    H, L, V, d = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["head_dim"]
    q, kv, E, k, I = (
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["num_experts"],
        c["num_experts_per_tok"],
        c["moe_intermediate_size"],
    )
    attention = H * q * d + 2 * H * kv * d + q * d * H + 2 * d
    experts = E * 3 * H * I
    per_layer = attention + E * H + experts + 2 * H
    total = L * per_layer + 2 * V * H + H
    return total, total - L * experts * (E - k) // E, L * experts


def gpt_oss_count(c: dict) -> tuple[int, int, int]:
    """(total, active, expert matrices' parameters): biased attention with per-head sinks, a biased router,
    E experts with a fused biased gate/up [H, 2I] and a biased down [I, H], two norms, untied head."""
    H, L, V, d = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["head_dim"]
    q, kv, E, k, I = (
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["num_local_experts"],
        c["num_experts_per_tok"],
        c["intermediate_size"],
    )
    attention = (H * q * d + q * d) + 2 * (H * kv * d + kv * d) + (q * d * H + H) + q
    matrices = E * (H * 2 * I + I * H)
    experts = matrices + E * (2 * I + H)
    per_layer = attention + E * H + E + experts + 2 * H
    total = L * per_layer + 2 * V * H + H
    return total, total - L * experts * (E - k) // E, L * matrices


def deepseek_count(c: dict) -> tuple[int, int, int, int]:
    """(total, active, routed-expert parameters, the fp8 linear weights): MLA attention (low-rank q and kv
    with their norms), 3 dense layers, then a sigmoid router, 256 routed and 1 shared expert."""
    H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    n, ql, kl = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    E, k, I, dense_layers = (
        c["n_routed_experts"],
        c["num_experts_per_tok"],
        c["moe_intermediate_size"],
        c["first_k_dense_replace"],
    )
    attention_linear = (
        H * ql + ql * n * (nope + rope) + H * (kl + rope) + kl * n * (nope + v) + n * v * H
    )
    attention = attention_linear + ql + kl
    dense_mlp = 3 * H * c["intermediate_size"]
    routed = E * 3 * H * I
    shared = 3 * H * I * c["n_shared_experts"]
    moe_layer = (
        E * H + routed + shared
    )  # (the router's score-correction bias is a buffer, not counted)
    layers = L - dense_layers
    total = L * (attention + 2 * H) + dense_layers * dense_mlp + layers * moe_layer + 2 * V * H + H
    fp8 = L * attention_linear + dense_layers * dense_mlp + layers * (routed + shared)
    return total, total - layers * routed * (E - k) // E, layers * routed, fp8


@pytest.mark.parametrize("size", ["30b-a3b", "235b-a22b"])
def test_qwen3_moe_plans_count_active_parameters_for_compute(tmp_path, size, capsys):
    config = QWEN3_MOE | QWEN3_SIZES[size]
    plan = plan_of(tmp_path, size, config)
    t = plan["target"]
    total, active, experts = qwen3_moe_count(config)
    assert (t["parameters"], t["active_parameters"], t["expert_parameters"]) == (
        total,
        active,
        experts,
    )
    published = {"30b-a3b": (30.5e9, 3.3e9), "235b-a22b": (235e9, 22e9)}[
        size
    ]  # the model cards' figures
    assert (
        abs(t["parameters"] / published[0] - 1) < 0.01
        and abs(t["active_parameters"] / published[1] - 1) < 0.03
    )
    assert (t["experts"], t["experts_per_token"], t["moe_layers"]) == (
        128,
        8,
        config["num_hidden_layers"],
    )
    assert t["quantization"] is None and t["stored_gb"] == pytest.approx(total * 2 / 1e9)
    assert t["replica_gb"] == pytest.approx(total * 2 / 1e9) and t["sharded_gb"] == pytest.approx(
        total * 2 / 8 / 1e9
    )
    assert (
        t["placement"] == "tensor-parallel"
    )  # 61 GB (30B) does not leave an 80 GB H100 room for the draft
    # the draft's MLP: the target's dense intermediate_size (8 experts x 768 = 6144 for the 30B)
    printed = " ".join(capsys.readouterr().out.split())
    assert f"intermediate size {config['intermediate_size']}" in printed
    assert f"{t['active_parameters'] / 1e9:.2f} B active" in printed
    # precompute's FLOPs: 2 per active non-embedding parameter and token, plus causal attention
    H, L, V = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    h = plan["hours"]
    flops = h["tokens"] * (2 * (active - V * H) + 2 * L * H * 1024)
    assert h["precompute_hours"] == pytest.approx(flops / (8 * 989e12 * 0.35) / 3600)


@pytest.mark.parametrize("size", ["20b", "120b"])
def test_gpt_oss_plans_size_the_mxfp4_checkpoint(tmp_path, size, capsys):
    config = (
        GPT_OSS
        | GPT_OSS_SIZES[size]
        | {
            "layer_types": ["sliding_attention", "full_attention"]
            * (GPT_OSS_SIZES[size]["num_hidden_layers"] // 2)
        }
    )
    total, active, matrices = gpt_oss_count(config)
    stored = (total - matrices) * 2 + matrices * 4.25 / 8  # 4-bit values + an 8-bit scale per 32
    V, H = config["vocab_size"], config["hidden_size"]
    # OpenAI's figures (21B / 3.6B and 117B / 5.1B active, the latter without the embedding) and
    # checkpoint sizes (13.8 GB, 65.3 GB of safetensors)
    published = {"20b": (20.9e9, 3.6e9, 13.8e9), "120b": (116.8e9, 5.1e9, 65.3e9)}[size]
    assert abs(total / published[0] - 1) < 0.01 and abs((active - V * H) / published[1] - 1) < 0.02
    assert abs(stored / published[2] - 1) < 0.01

    vllm = plan_of(tmp_path, f"{size}-vllm", config, "--target-engine", "vllm", "--gpu", "l40s")
    t = vllm["target"]
    assert (t["parameters"], t["active_parameters"]) == (total, active)
    assert t["quantization"] == "mxfp4" and t["stored_gb"] == pytest.approx(stored / 1e9)
    assert t["replica_gb"] == pytest.approx(stored / 1e9) and t["sharded_gb"] == pytest.approx(
        stored / 8 / 1e9
    )
    hf = plan_of(
        tmp_path, f"{size}-hf", config, "--gpu", "l40s"
    )  # transformers: dequantized to bf16 (said)
    assert hf["target"]["replica_gb"] == pytest.approx(total * 2 / 1e9)
    printed = " ".join(capsys.readouterr().out.split())
    assert (
        "as stored (what --target-engine vllm keeps)" in printed and "dequantizes mxfp4" in printed
    )
    # 20b: as stored it fits one 48 GB GPU beside the draft; in bf16 (41.8 GB) it does not
    if size == "20b":
        assert t["placement"] == "replica" and hf["target"]["placement"] == "tensor-parallel"
    # the live target's forward holds one MLP's activations at a time: for gpt-oss 4 experts' [T, 2 x 2880]
    # per token, not the dense field's one
    from spec_cli.targets.supervision import LOGITS_CHUNK_BYTES

    row = vllm["steps"][0]
    width = 4 * config["intermediate_size"]  # k experts' intermediate
    forward = (
        row["seq_len"] * (2 * 32000 * 4 + (3 + 2) * H * 2 + 2 * width * 2) + 3 * LOGITS_CHUNK_BYTES
    )
    if size == "20b":  # a replica on the 48 GB GPU: its weights as stored plus that forward
        assert row["need_live_gb"] == pytest.approx(
            row["need_gb"] + stored / 1e9 + forward / 1e9, rel=1e-9
        )
    # gpt-oss's intermediate_size is one expert's: the draft takes it (and says so)
    assert "intermediate size 2880" in printed and "here one expert's width" in printed


def test_deepseek_v3_mla_plan(tmp_path):
    total, active, routed, fp8 = deepseek_count(DEEPSEEK_V3)
    assert (
        abs(total / 671e9 - 1) < 0.01 and abs(active / 37.5e9 - 1) < 0.04
    )  # DeepSeek's 671B / 37B
    plan = plan_of(tmp_path, "dsv3", DEEPSEEK_V3, "--target-engine", "vllm", "--gpu", "h200")
    t = plan["target"]
    assert (t["parameters"], t["active_parameters"], t["expert_parameters"]) == (
        total,
        active,
        routed,
    )
    assert (t["experts"], t["experts_per_token"], t["moe_layers"]) == (256, 8, 58)
    stored = (total - fp8) * 2 + fp8 * (
        1 + 4 / 128**2
    )  # fp8 values + an fp32 scale per 128 x 128 block
    assert t["stored_gb"] == pytest.approx(stored / 1e9, rel=1e-6)
    assert t["placement"] == "tensor-parallel" and t["sharded_gb"] == pytest.approx(
        stored / 8 / 1e9, rel=1e-6
    )
