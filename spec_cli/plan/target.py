"""The target as `spec plan` counts it: total and active parameters, and the bytes of its weights as the
checkpoint stores them and as each target engine keeps them.

A mixture-of-experts layer holds E routed experts and runs k of them per token, so its compute is that
of k experts while its memory is that of E. Counted on the transformers model built on the meta device
(no memory): every parameter under a module path segment named `experts` (Qwen3-MoE, gpt-oss, Mixtral,
DeepSeek-V3 ...; DeepSeek's `shared_experts` run for every token and count as dense) is a routed
expert's, and a token uses k/E of them. E and k come from the config (num_experts / num_local_experts /
n_routed_experts; num_experts_per_tok / experts_per_token).

Quantized checkpoints are counted by what they store: gpt-oss ships its experts' weight matrices in
MXFP4 (4-bit values, one 8-bit scale per 32: 4.25 bits a value; attention, router, embedding, head and
biases in bf16); DeepSeek-V3 ships its decoder's linear weights in FP8 with one fp32 scale per 128x128
block. vLLM serves both as stored; transformers dequantizes MXFP4 to bf16 without its GPU kernels, so
a live transformers target is counted at bf16 (an upper bound, said so). Another quantization method is
counted at bf16 and named in the plan's notes.

What the plan shapes is a transformer decoder: a state-space or recurrent model (Mamba, RWKV, xLSTM: a
transformers config class with layers and no attention heads) is refused, and a model type transformers
does not know is planned as a Llama-style dense decoder, said so (plan_assumption).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN_KEYS = (
    "num_experts_per_tok",
    "experts_per_token",
    "num_experts_per_token",
    "moe_topk",
)
# bytes per stored value of the quantized weights (scales included)
QUANTIZED_BYTES = {"mxfp4": 4.25 / 8, "fp8": 1 + 4 / (128 * 128)}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# the fields a plan of a Llama-style dense decoder reads (the draft's shape, the target's count by formula)
DECODER_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


@dataclass
class TargetCount:
    total: int  # parameters
    active: int  # parameters a token runs through (all of a dense target's)
    embedding: int  # the input embedding's (a table lookup: no FLOPs)
    experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int
    expert_parameters: int  # in all routed experts, all layers
    moe_layers: int
    quantization: str | None  # the checkpoint's quant_method (mxfp4, fp8, ...), None: not quantized
    quantized_parameters: int  # stored in QUANTIZED_BYTES[quantization] bytes each (0: none known)
    mlp_width: int  # the widest per-token MLP activation: the dense intermediate size, or k experts' (+ shared)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def bf16_bytes(self) -> int:
        return self.total * 2

    def stored_bytes(self) -> int:
        """The weights as the checkpoint stores them (bf16 where not quantized): what vLLM keeps."""
        per = QUANTIZED_BYTES.get(self.quantization or "")
        if per is None:
            return self.bf16_bytes()
        return round((self.total - self.quantized_parameters) * 2 + self.quantized_parameters * per)

    def engine_bytes(self, engine: str) -> int:
        """What a live target of this engine keeps: vLLM as stored, transformers dequantized to bf16."""
        return self.stored_bytes() if engine == "vllm" else self.bf16_bytes()


def plan_assumption(text) -> str | None:
    """What the plan assumes of the target whose language model's config is `text`, in words (None: its
    transformers class, nothing assumed); raises ConfigError for a target it cannot plan: one without
    attention layers, or a config without a field the plan reads."""
    from transformers import PretrainedConfig

    from spec_cli.errors import ConfigError

    kind = getattr(text, "model_type", None) or "(none)"
    known = type(text) is not PretrainedConfig
    if known and _attention_free(type(text)):
        raise ConfigError(
            f"model_type {kind!r} ({type(text).__name__}) is a state-space or recurrent model (no "
            "attention layers), not a transformer decoder",
            "spec plan plans drafts for transformer decoders (Llama, Qwen, Mistral, Gemma, MoE ...)",
        )
    # a known class supplies its own defaults (what transformers loads); an unknown type has only its file
    needed = [f for f in DECODER_FIELDS if not (known and f == "intermediate_size")]
    missing = [f for f in needed if not _positive_int(getattr(text, f, None))]
    if missing:
        raise ConfigError(
            f"the target's config (model_type {kind!r}) has no {', '.join(missing)}, which "
            "spec plan needs to shape the draft and count the target",
            "add it to config.json, or pass the model's own config.json",
        )
    if known:
        return None
    return (
        f"model_type {kind!r} is not one transformers knows: planned as a Llama-style dense decoder "
        "(attention + gated MLP per layer)"
    )


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _attention_free(cls) -> bool:
    """A transformers config class whose models have layers and no attention heads (Mamba, Mamba-2,
    FalconMamba, RWKV, xLSTM: state-space or recurrent blocks), told by its defaults."""
    try:
        default = cls()
    except Exception:  # noqa: BLE001 (a class that needs arguments): not told apart, planned as given
        return False
    return hasattr(default, "num_hidden_layers") and not hasattr(default, "num_attention_heads")


def config_value(config, keys: tuple[str, ...]) -> int:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def quant_method(config) -> str | None:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method)).lower() if method else None


def _is_expert(name: str) -> bool:
    return "experts" in name.split(".")


def _quantized(name: str, shape: tuple[int, ...], method: str | None) -> bool:
    """Whether the checkpoint stores this parameter quantized (the methods QUANTIZED_BYTES knows)."""
    if method not in QUANTIZED_BYTES or len(shape) < 2 or name.endswith("bias"):
        return False
    if method == "mxfp4":  # gpt-oss: the experts' matrices only
        return _is_expert(name)
    parts = name.split(".")  # fp8: the decoder's linear weights, not the router, embedding or head
    return "layers" in parts and not {"gate", "router", "embed_tokens", "norm"} & set(parts[-2:-1])


def count(config, text, build) -> TargetCount:
    """Count the target (`text`: its language model's config) from `build()`'s meta-device model, or
    by formula for a decoder transformers cannot build (`build` raising)."""
    E = config_value(text, EXPERT_COUNT_KEYS)
    k = config_value(text, EXPERTS_PER_TOKEN_KEYS) if E else 0
    method = quant_method(config) or quant_method(text)
    H = text.hidden_size
    dense = getattr(text, "intermediate_size", None) or 4 * H
    expert_width = getattr(text, "moe_intermediate_size", None) or dense
    shared = (getattr(text, "n_shared_experts", None) or 0) * expert_width + (
        getattr(text, "shared_expert_intermediate_size", None) or 0
    )
    try:
        model = build()
    except Exception:  # noqa: BLE001 (an architecture this transformers cannot build): by formula
        return _formula(config, text, E, k, method, dense, expert_width, shared)
    total = embedding = experts = quantized = 0
    moe_layers: set[int] = set()
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embed_ids = {id(p) for p in embed.parameters()} if embed is not None else set()
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if id(p) in embed_ids:
            embedding += n
        if _is_expert(name):
            experts += n
            layer = _LAYER.search(name)
            if layer:
                moe_layers.add(int(layer.group(1)))
        if _quantized(name, tuple(p.shape), method):
            quantized += n
    if not experts:
        E = k = 0
    active = total - round(experts * (1 - k / E)) if E else total
    layers = getattr(text, "num_hidden_layers", 0) or 0
    width = max(k * expert_width + shared if E else 0, dense if len(moe_layers) < layers else 0)
    return TargetCount(
        total, active, embedding, E, k, experts, len(moe_layers), method, quantized, width
    )


def _formula(
    config, text, E: int, k: int, method, dense: int, expert_width: int, shared: int
) -> TargetCount:
    H, L, V = text.hidden_size, text.num_hidden_layers, text.vocab_size
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    d = getattr(text, "head_dim", None) or H // heads
    attention = H * d * (heads * 2 + kv * 2)
    if E:
        mlp, routed = 3 * H * shared + H * E, 3 * H * expert_width * E
    else:
        mlp, routed = 3 * H * dense, 0
    tied = getattr(config, "tie_word_embeddings", False)
    total = L * (attention + mlp + routed + 2 * H) + V * H * (1 if tied else 2) + H
    active = total - round(L * routed * (1 - k / E)) if E else total
    quantized = L * routed if method in QUANTIZED_BYTES else 0
    width = k * expert_width + shared if E else dense
    return TargetCount(
        total, active, V * H, E, k, L * routed, L if E else 0, method, quantized, width
    )
