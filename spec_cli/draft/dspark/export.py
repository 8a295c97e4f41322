"""DSpark's writer: DFlash's folder (spec_cli/draft/dflash/export.py: the Qwen3 layer fields, fc's columns
in ascending layer order, no embed_tokens, d2t only when Vd < V) plus what vLLM 0.32's DSpark loader reads
(model_executor/models/qwen3_dspark.py, transformers_utils/configs/speculators/algos.py update_dspark):

- vLLM's own format: `architectures: ["Qwen3DSparkModel"]`, `markov_rank`, `enable_confidence_head`,
  `confidence_head_with_markov`, `block_size` (vLLM's num_speculative_tokens defaults to it),
  `sample_from_anchor: true` (the anchor predicts: B queries, B drafts), the DFlash `dflash_config`
  (target layers as 0-indexed outputs, the noise token as mask_token_id, non-causal);
- the speculators format: `speculators_model_type: "dspark"`, DFlash's fields, `markov_rank`,
  `markov_head_type: "vanilla"`, the confidence head's two flags, `sample_from_anchor: true` (vLLM's
  translation defaults it to false, the DFlash layout), `speculative_tokens` = B;
- weights: DFlash's plus markov_head.markov_w1 / markov_w2 (the model's dtype) and confidence_head.proj
  in fp32 (vLLM builds that head in fp32); no confidence head when the draft has none.
"""

from __future__ import annotations

import torch

from spec_cli.draft.contract import Checkpoint, ExportFiles
from spec_cli.draft.dflash import export as dflash
from spec_cli.draft.eagle3.export import speculators_block
from spec_cli.errors import ExportError

FORMATS = dflash.FORMATS


def build(src: Checkpoint, fmt: str, dtype: torch.dtype) -> ExportFiles:
    if fmt not in FORMATS:
        raise ExportError(
            f"DSpark drafts are not written as --format {fmt}", f"use one of {', '.join(FORMATS)}"
        )
    files = dflash.build(src, fmt, dtype)
    x = src.config.extra
    size = int(x["block_size"])
    heads = {
        "markov_rank": int(x["markov_rank"]),
        "enable_confidence_head": bool(x["confidence_head"]),
        "confidence_head_with_markov": bool(x["confidence_head"] and x["confidence_with_markov"]),
        "block_size": size,
        "sample_from_anchor": True,
    }
    config = files.config
    if fmt == "vllm":
        config["architectures"] = ["Qwen3DSparkModel"]
        config.update(heads, dspark_bonus_anchor=False)
    else:
        config.update(
            architectures=["DSparkSpeculator"],
            speculators_model_type="dspark",
            markov_head_type="vanilla",
            speculators_config=speculators_block(src, "dspark", size),
            **heads,
        )
        config.pop("sliding_window_non_causal", None)
        config["sliding_window_non_causal"] = (
            True  # (after the heads: the key order of the peers' files)
        )
    config["spec_cli"] = config.pop("spec_cli")  # (last, as for every format)
    for key in [k for k in files.tensors if k.startswith("confidence_head.")]:
        files.tensors[key] = src.state[key].to(torch.float32).contiguous()  # vLLM's head is fp32
    files.num_speculative_tokens = size
    return files
