"""DFlash's writer: a draft checkpoint -> the config.json and model.safetensors vLLM 0.32 loads as is.

vLLM (model_executor/models/qwen3_dflash.py DFlashQwen3ForCausalLM, v1/spec_decode/dflash.py):
- the architecture `DFlashDraftModel` (registry.py) over a Qwen3 config: hidden size, heads, head_dim,
  rope, rms_norm_eps, intermediate size, `num_hidden_layers` = the draft's layers;
- `dflash_config.target_layer_ids`: 0-indexed decoder layer OUTPUTS (spec_cli's own convention; vLLM adds
  1 to capture them, eagle3_utils.py get_eagle3_aux_layers_from_config), concatenated in ascending layer
  order, so fc's column blocks are written in that order; `dflash_config.mask_token_id` (the proposer's
  parallel-drafting token); `dflash_config.causal: false` (every layer non-causal inside the block, as
  trained; with no layer_types entry naming sliding attention vLLM reads the same, but the key says it);
- the weights unprefixed (vLLM adds `model.`): layers.{i}.*, fc, hidden_norm, norm; lm_head [Vd, H];
  d2t (offsets, loaded as draft_id_to_target_id) when Vd < V; never embed_tokens (vLLM shares the
  target's, which the draft's frozen copy equals), never mask_hidden (a load error), t2d skipped;
- `num_speculative_tokens` = block_size - 1 (vLLM reads no block size: one bonus query and K masks).
The speculators format (`speculators_model_type: dflash`; vLLM transformers_utils/configs/speculators/
algos.py update_dflash) names the layers `aux_hidden_state_layer_ids` in vLLM's capture convention
(output of layer i -> i + 1), keeps t2d, and must say `sliding_window_non_causal: true`: vLLM turns that
key into `causal = not value`, and speculators' own config class writes false (causal) by default.
"""

from __future__ import annotations

import torch

from spec_cli.draft.contract import Checkpoint, ExportFiles, provenance
from spec_cli.draft.dflash.model import block_size
from spec_cli.draft.eagle3.export import llama_layer, speculators_block
from spec_cli.errors import ExportError

FORMATS = ("vllm", "speculators")


def build(src: Checkpoint, fmt: str, dtype: torch.dtype) -> ExportFiles:
    if fmt not in FORMATS:
        raise ExportError(
            f"DFlash drafts are not written as --format {fmt}", f"use one of {', '.join(FORMATS)}"
        )
    c = src.config
    n = len(c.aux_layer_ids)
    order = sorted(range(n), key=lambda j: c.aux_layer_ids[j])
    outputs = [c.aux_layer_ids[j] for j in order]
    steps = block_size(c) - 1
    tensors = _tensors(src, fmt, order, dtype)
    layer = qwen3_layer(src, dtype)
    if fmt == "vllm":
        ids = outputs
        config = {
            "architectures": ["DFlashDraftModel"],
            **layer,
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "block_size": block_size(c),
            "num_target_layers": c.target_num_layers,
            "dflash_config": {
                "target_layer_ids": ids,
                "mask_token_id": c.mask_token_id,
                "causal": False,
            },
        }
    else:
        ids = [i + 1 for i in outputs]
        config = {
            "architectures": ["DFlashSpeculator"],
            "model_type": "speculators",
            "speculators_model_type": "dflash",
            "transformer_layer_config": layer,
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "block_size": block_size(c),
            "mask_token_id": c.mask_token_id,
            "aux_hidden_state_layer_ids": ids,
            "sliding_window_non_causal": True,  # vLLM: causal = not this (see the module docstring)
            "sample_from_anchor": False,
            "tie_word_embeddings": False,
            "speculators_config": speculators_block(src, "dflash", steps),
        }
    config["spec_cli"] = provenance(src, fmt, dtype)
    return ExportFiles(
        format=fmt,
        config=config,
        tensors=tensors,
        engine_aux_ids=ids,
        aux_layer_outputs=outputs,
        num_speculative_tokens=steps,
    )


def qwen3_layer(src: Checkpoint, dtype: torch.dtype) -> dict:
    """The Qwen3Config fields vLLM builds the draft's layers from: the Llama layer's (rope, sizes, the
    TARGET vocab for the shared embedding and the d2t range, no biases), all of them full attention."""
    layer = {k: v for k, v in llama_layer(src, dtype).items() if k != "mlp_bias"}
    layer.update(
        {
            "model_type": "qwen3",
            "layer_types": ["full_attention"] * src.config.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    )
    return layer


def _tensors(src: Checkpoint, fmt: str, order: list[int], dtype: torch.dtype) -> dict:
    state = dict(src.state)
    c = src.config
    blocks = state["fc.weight"].split(c.target_hidden_size, dim=1)
    state["fc.weight"] = torch.cat([blocks[j] for j in order], dim=1)
    state.pop("embed_tokens.weight", None)  # vLLM shares the target's
    if fmt == "vllm":
        state.pop("t2d")  # vLLM skips it
    if (
        c.draft_vocab_size == c.vocab_size
    ):  # vLLM builds no draft_id_to_target_id: the map must be the identity
        if bool(state["d2t"].any()):
            raise ExportError(
                "the draft vocab is the whole target vocab in another order, which vLLM's DFlash "
                "model cannot map",
                "rebuild the vocab map (a full vocab is the identity)",
            )
        state.pop("d2t")
        state.pop("t2d", None)
    out = {}
    for key, value in state.items():
        if key == "d2t":
            out[key] = value.to(torch.int64).contiguous()
        elif key == "t2d":
            out[key] = value.to(torch.bool).contiguous()
        else:
            out[key] = value.to(dtype).contiguous()
    return out
