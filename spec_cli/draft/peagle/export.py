"""P-EAGLE export: EAGLE-3's files (spec_cli/draft/eagle3/export.py) plus what parallel drafting reads.

vLLM 0.32 (model_executor/models/llama_eagle3.py Eagle3LlamaForCausalLM; v1/spec_decode/
llm_base_proposer.py) with `"parallel_drafting": true` on an eagle3 speculative config:
- `mask_hidden` (any shape holding 3*H_t values; speculators writes [1, 1, 3*H_t]) is copied into a
  buffer, and a missing one is a load error; it is passed through combine_hidden_states (fc_norm, fc)
  once to give the mask slots' state;
- the mask slots' token is config.json's `mask_token_id` (the proposer also reads `pard_token`,
  `ptd_token_id`); without one vLLM refuses to start.
The speculators format names the algorithm `peagle` (vLLM turns that into eagle3 + parallel_drafting
and `mask_token_id` into `pard_token`: transformers_utils/configs/speculators/algos.py update_peagle).
SGLang has no parallel drafting: the format is refused rather than served as a plain EAGLE-3 chain.
"""

from __future__ import annotations

import torch

from spec_cli.draft.contract import Checkpoint, ExportFiles
from spec_cli.draft.eagle3 import export as eagle3_export
from spec_cli.errors import ExportError

FORMATS = ("vllm", "speculators")
SERVING_STEPS = 3


def build(src: Checkpoint, fmt: str, dtype: torch.dtype) -> ExportFiles:
    if (
        fmt not in FORMATS
    ):  # SGLang has no parallel drafting: it would serve the draft as an EAGLE-3 chain
        raise ExportError(
            f"P-EAGLE drafts are not written as --format {fmt}", f"use one of {', '.join(FORMATS)}"
        )
    state = dict(src.state)
    mask = state.pop("mask_hidden.weight")
    # the engines concatenate the aux states in ascending layer order: reorder the mask's chunks as fc's
    order = sorted(range(3), key=lambda j: src.config.aux_layer_ids[j])
    chunks = mask.reshape(-1).split(src.config.target_hidden_size)
    mask = torch.cat([chunks[j] for j in order]).view(1, 1, -1)
    files = eagle3_export.build(_Without(src, state), fmt, dtype)
    files.tensors["mask_hidden"] = mask.to(dtype).contiguous()
    steps = min(SERVING_STEPS, src.ttt_steps or SERVING_STEPS)
    files.num_speculative_tokens = steps
    config = files.config
    config["mask_token_id"] = src.config.mask_token_id
    if fmt == "speculators":
        config["architectures"] = ["PEagleSpeculator"]
        config["speculators_model_type"] = "peagle"
        config["speculators_config"]["algorithm"] = "peagle"
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = steps
    return files


class _Without:
    """The checkpoint with another state (EAGLE-3's writer reads only these fields)."""

    def __init__(self, src: Checkpoint, state: dict):
        self.checkpoint, self.step, self.config = src.checkpoint, src.step, src.config
        self.target, self.ttt_steps, self.state = src.target, src.ttt_steps, state
