"""Tiny random targets whose attention is not all full, built in the tests (no downloads).

- "llama":   every layer full attention (the regression case);
- "mistral": every layer sliding (config.sliding_window, no layer_types);
- "gemma3":  sliding and full layers (layer_types), embedding scale, tied head;
- "llama4":  chunked and full layers (attention_chunk_size);
- "qwen3next": linear-attention (gated delta rule) and full layers: what masks cannot express.

WINDOW is small, so prompts and documents of a few dozen tokens already run past every window.
"""

from __future__ import annotations

from pathlib import Path

from tests import tiny

WINDOW = 8
FAMILY = {
    "llama": "llama3",
    "mistral": "mistral",
    "gemma3": "gemma",
    "llama4": "llama3",
    "qwen3next": "chatml",
}  # tests/tiny.py chat-template family of each
AUX = [1, 2, 3]  # aux layer outputs of the 6-layer targets


def config(
    arch: str, vocab_size: int, window: int = WINDOW, num_layers: int = 6, tied: bool = False
):
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        tie_word_embeddings=tied,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=window)
    if arch == "gemma3":
        kinds = ["sliding_attention", "sliding_attention", "full_attention"]
        return transformers.Gemma3TextConfig(
            **common, sliding_window=window, layer_types=(kinds * num_layers)[:num_layers]
        )
    if arch == "llama4":
        return transformers.Llama4TextConfig(
            **common,
            intermediate_size_mlp=64,
            attention_chunk_size=window,
            num_local_experts=1,
            interleave_moe_layer_step=1,
        )
    if arch == "qwen3next":
        return transformers.Qwen3NextConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        )
    raise ValueError(arch)


def model(arch: str, vocab_size: int = 256, seed: int = 0, head_scale: float = 1.0, **kwargs):
    """A random causal LM in eval mode; head_scale > 1 makes its next-token distributions peaked (an
    untied head only: a tied one would scale the embeddings too)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config(arch, vocab_size, **kwargs)).eval()
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(head_scale)
    return m


def save_target(path: Path, arch: str, seed: int = 0, **kwargs) -> Path:
    """A transformers folder (tokenizer of the arch's chat family + random weights)."""
    tokenizer = tiny.build_tokenizer(FAMILY[arch])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    model(arch, len(tokenizer), seed, **kwargs).save_pretrained(str(path))
    return path
