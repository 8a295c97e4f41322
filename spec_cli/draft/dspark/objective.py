"""DSpark's training objective: DFlash's blocks at every slot (spec_cli/draft/dflash/objective.py), each
query scored with the Markov-biased logits of the true previous token, and three terms per element.

Elements. Slot t's block holds x[t + 1] (the anchor) and B - 1 noise tokens at positions t + 1 .. t + B;
query i proposes x[t + 2 + i] with x[t + 1 + i] (the shifted batch's input_ids[t + i]) as its previous
token, and is scored at the shifted batch's row s = t + i (target_p, target_ids, loss_mask and
position_mask there): query i predicts what DFlash's offset i + 1 does. It counts while s stays in t's
document with loss_mask set, and is supervised where the target's top-1 is in the draft vocab.

Loss (the DSpark paper's three terms, weights --ce-weight, --l1-weight, --confidence-weight):
- hard cross-entropy of the biased logits against the target's top-1 token (the argmax of target_p, a
  draft id where position_mask holds; on regenerated data the data's own token);
- L1 between the draft's softmax and the target's full-vocab distribution, ||q - p||_1 = 2 (1 - alpha)
  with alpha = sum_v min(q_v, p_v) over the draft vocab (the target's mass outside it is always missed);
- binary cross-entropy of the confidence head against alpha (detached): alpha is the probability that
  speculative sampling accepts the position given the ones before it (the head's meaning in vLLM).
Query i's elements weigh w_i = exp(-i / G) (--block-decay G; default DFlash's for a block of B + 1), and
the loss is the weighted mean over supervised elements, sum_i w_i sum_n loss / sum_i w_i N_i, as DFlash's.
Metrics per query: `step_loss` (its mean of the three-term loss), `correct` / `total` (top-1 hits of the
biased logits over its counted elements), `supervised`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from spec_cli.batch import TargetBatch
from spec_cli.draft.contract import Objective
from spec_cli.draft.dflash.objective import run_blocks
from spec_cli.draft.dspark import CONFIDENCE_WEIGHT, decay
from spec_cli.draft.dspark.model import DSparkDraft
from spec_cli.draft.losses import HEAD_CHUNK_BYTES, acceptance, top1_hits
from spec_cli.draft.unroll import ObjectiveOutput
from spec_cli.errors import ConfigError


def position_weights(size: int, g: float) -> list[float]:
    """w_i = exp(-i / G) for queries i = 0 .. size - 1."""
    return [math.exp(-i / g) for i in range(size)]


class DSparkObjective(Objective):
    """The draft and its DSpark loss behind one forward(batch), so DDP can wrap it."""

    def __init__(self, draft: DSparkDraft, options, activation_checkpointing: bool = False):
        super().__init__()
        if options.loss != "soft-ce":
            raise ConfigError(
                f"--loss {options.loss} does not apply to DSpark, whose loss is its own mix of hard "
                "cross-entropy, L1 and the confidence head's BCE",
                "drop --loss; weigh the terms with --ce-weight, --l1-weight and --confidence-weight",
            )
        mine_of = {
            "confidence_with_markov": options.confidence_with_markov and options.confidence_head
        }
        for name in ("block_size", "markov_rank", "confidence_head", "confidence_with_markov"):
            mine, its = mine_of.get(name, getattr(options, name)), draft.config.extra[name]
            if mine != its:
                flag = name.replace("_", "-")
                raise ConfigError(
                    f"--{flag} {mine} differs from the draft's {its} (it is part of the draft)",
                    f"pass the draft's --{flag} value when resuming",
                )
        if (
            draft.confidence_head is None and options.confidence_weight != CONFIDENCE_WEIGHT
        ):  # (set, so meant)
            raise ConfigError(
                f"--confidence-weight {options.confidence_weight} without a confidence head "
                "(--no-confidence-head) weighs nothing",
                "drop one of the two options",
            )
        self.draft = draft
        self.size = draft.block_size
        self.decay = options.block_decay or decay(self.size)
        self.weights = (
            options.ce_weight,
            options.l1_weight,
            options.confidence_weight if draft.confidence_head is not None else 0.0,
        )
        self.max_anchors = options.max_anchors
        self.checkpoint = activation_checkpointing

    def forward(self, batch: TargetBatch, unit=None) -> ObjectiveOutput:
        draft, size = self.draft, self.size
        states, counted, pairs, n_supervised = run_blocks(
            draft, batch, size, 0, self.max_anchors, self.checkpoint, self.training
        )
        weights = position_weights(size, self.decay)
        den = sum(w * n for w, n in zip(weights, n_supervised.float().unbind(0)))
        total = states[0].new_zeros((), dtype=torch.float32)
        losses, correct = [], []
        for i, (state, (where, at)) in enumerate(zip(states, pairs)):  # query i, scored at t + i
            value, hits = self.terms(state, where, batch, at)
            total = total + weights[i] * value * n_supervised[i] / den.clamp_min(1e-12)
            losses.append(value.detach())
            correct.append(hits)
        return ObjectiveOutput(
            loss=total,
            step_loss=torch.stack(losses),
            correct=torch.stack(correct),
            total=counted,
            supervised=n_supervised,
        )

    def terms(self, state: torch.Tensor, where: tuple, batch: TargetBatch, at: tuple):
        """The mean three-term loss of one query's N elements and their top-1 hits; under activation
        checkpointing chunk by chunk of elements, each recomputed in backward (no [N, Vd] kept)."""
        n = where[0].shape[0]
        if not self.checkpoint or n == 0:
            value, hits = _terms(
                self.draft,
                self.weights,
                state,
                where,
                batch.input_ids,
                batch.target_p,
                batch.target_mass,
                batch.target_ids,
                at,
            )
            return value / max(n, 1), hits
        chunk = max(1, HEAD_CHUNK_BYTES // (4 * self.draft.config.draft_vocab_size))
        value, hits = state.new_zeros((), dtype=torch.float32), 0
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            v, h = activation_checkpoint(
                _terms,
                self.draft,
                self.weights,
                state,
                tuple(x[part] for x in where),
                batch.input_ids,
                batch.target_p,
                batch.target_mass,
                batch.target_ids,
                tuple(x[part] for x in at),
                use_reentrant=False,
            )
            value, hits = value + v, hits + h
        return value / n, hits


def _terms(
    draft: DSparkDraft,
    weights: tuple,
    state,
    where,
    input_ids,
    target_p,
    target_mass,
    target_ids,
    at,
):
    """(the three-term loss summed over the elements, their top-1 hits) for state[where] scored at
    `at`; the previous token of each is input_ids[at] (x[t + 1 + i] for query i of slot t)."""
    ce_w, l1_w, conf_w = weights
    hidden = state[where]  # [N, H]
    embed = draft.markov_embed(input_ids[at])  # [N, r]
    logits = draft.biased_logits(hidden, embed)  # [N, Vd]
    p = target_p[at]
    alpha = acceptance(logits, p, target_mass[at])  # [N]
    value = l1_w * 2 * (1 - alpha).sum()
    if ce_w:
        value = value + ce_w * F.cross_entropy(logits.float(), p.argmax(-1), reduction="sum")
    if conf_w:
        value = value + conf_w * F.binary_cross_entropy_with_logits(
            draft.confidence_logit(hidden, embed), alpha.detach().float(), reduction="sum"
        )
    return value, top1_hits(logits.detach().argmax(-1), draft.d2t, target_ids[at])
