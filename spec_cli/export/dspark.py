"""The reading rules of DSpark exports (DSPARK.export_rules): DFlash's (spec_cli/export/dflash.py: the
backbone's config, weights, layers and causality as vLLM reads them) with what vLLM 0.32 adds for DSpark,
written from its loader, never with the writer's code (spec_cli/draft/dspark/export.py):

    config    vllm/transformers_utils/configs/speculators/algos.py update_dspark (the speculators format ->
              Qwen3DSparkModel: aux_hidden_state_layer_ids as eagle_aux_hidden_state_layer_ids, the heads'
              fields copied, sample_from_anchor default FALSE there; no sliding_window_non_causal key: the
              block's causality comes from the layer types); v1/worker/gpu/spec_decode/dspark/speculator.py
              (vLLM's own format: sample_from_anchor default TRUE; num_speculative_tokens defaults to
              block_size); qwen3_dspark.py Qwen3DSparkModel: markov_rank required, the confidence head only
              with enable_confidence_head, its input H + r with confidence_head_with_markov
    weights   Qwen3DSparkForCausalLM.load_weights: DFlash's names plus markov_head.markov_w1 [V, r],
              markov_head.markov_w2 [Vd, r], confidence_head.proj.{weight, bias} (fp32; dropped when the file
              has none); mask_embedding ignored
    decoding  the speculator's sequential sampling: position i's logits are the block's plus
              markov_w2(markov_w1[the previous token]); the confidence head sigmoid(proj(cat[h_i, w1[prev]]))
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_cli.draft.unroll import shift_left
from spec_cli.export import dflash
from spec_cli.export.check import CheckReport
from spec_cli.export.reader import ReadExport

__all__ = ["check", "read", "recognise"]


def _heads(raw: dict, fmt: str, view: dflash.View) -> None:
    rank = raw.get("markov_rank")
    if not isinstance(rank, int) or rank < 1:
        view.problems.append(f"markov_rank is {rank!r}: vLLM's DSpark model needs a positive rank")
        rank = 0
    confidence = bool(raw.get("enable_confidence_head", False))
    view.heads = {
        "markov_rank": rank,
        "confidence_head": confidence,
        "confidence_with_markov": confidence
        and bool(raw.get("confidence_head_with_markov", False)),
    }
    if not raw.get("sample_from_anchor", fmt == "vllm"):
        view.problems.append(
            "sample_from_anchor is false: vLLM would run the block with the anchor as a bonus token "
            "(1 + N queries); the draft was trained to propose from its anchor"
        )
    if raw.get("markov_head_type", "vanilla") != "vanilla":
        view.problems.append(
            f"markov_head_type {raw['markov_head_type']!r}: vLLM's DSpark model has the vanilla head only"
        )
    if fmt == "vllm" and raw.get("block_size") is not None:
        view.speculative_tokens = int(raw["block_size"])  # vLLM's default num_speculative_tokens


def _params(v: dflash.View) -> dict[str, tuple[int, ...]]:
    L, h = v.layer, v.heads
    out = {
        "markov_head.markov_w1.weight": (L.vocab_size, h["markov_rank"]),
        "markov_head.markov_w2.weight": (v.draft_vocab_size, h["markov_rank"]),
    }
    if h["confidence_head"]:
        width = L.hidden_size + (h["markov_rank"] if h["confidence_with_markov"] else 0)
        out.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return out


@torch.no_grad()
def _predict(draft, ids, aux, positions):
    """([(biased logits, target ids)] of every block position, a block anchored at every slot with the true
    previous tokens, [(confidence logits as [-c, c], accepted?)] of each position when the draft has the head)."""
    states = draft.block_forward(ids, aux, positions, first=0)
    out, conf = [], []
    for i, state in enumerate(states):
        embed = draft.markov_embed(shift_left(ids, i))
        logits = draft.biased_logits(state, embed).float()
        out.append((logits, draft.to_target_ids(logits.argmax(-1))))
        if draft.confidence_head is not None:
            c = draft.confidence_logit(state, embed)[..., None]
            conf.append((torch.cat([-c, c], -1), (c[..., 0] > 0).long()))
    return out, conf


DSPARK = dflash.Family(
    title="DSpark",
    algorithm="dspark",
    architectures=("Qwen3DSparkModel",),
    speculators_type="dspark",
    first=0,
    reads_causal_key=False,
    heads=_heads,
    params=_params,
    predict=_predict,
    fp32=("confidence_head.",),
)


def recognise(raw: dict) -> str | None:
    return dflash.recognise(raw, DSPARK)


def check(folder: Path, fmt: str, src, dtype: torch.dtype) -> CheckReport:
    return dflash.check(folder, fmt, src, dtype, DSPARK)


def read(folder: Path, fmt: str, target_config) -> ReadExport:
    return dflash.read(folder, fmt, target_config, DSPARK)
