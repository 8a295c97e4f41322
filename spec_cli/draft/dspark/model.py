"""The DSpark draft, as vLLM 0.32 builds it (model_executor/models/qwen3_dspark.py Qwen3DSparkModel: the
DFlash Qwen3 backbone, spec_cli/draft/dflash/model.py, plus two heads).

Parameters beyond DFlash's (the names vLLM loads, after its `model.` prefix):

    markov_head.markov_w1.weight     [V, r]     the previous token (target vocab) -> its Markov embedding
    markov_head.markov_w2.weight     [Vd, r]    the embedding -> a bias on the draft-vocab logits
    confidence_head.proj.weight      [1, H (+ r)], .bias [1]   fp32 (vLLM keeps them in fp32)

Block. After the target verified up to position p - 1, the block is [the newest token x_p, noise x (B - 1)]
at positions p .. p + B - 1 (the noise token is DFlash's mask token); query i's final state h_i proposes
the token at p + 1 + i (vLLM's `sample_from_anchor`: the anchor predicts too). Its logits are
lm_head(h_i) + markov_w2(markov_w1[y_{i-1}]), y_{-1} = x_p and y_{i-1} the token drafted at i - 1, so
the block is sampled left to right; the confidence head gives sigmoid(proj(cat[h_i, markov_w1[y_{i-1}]]))
(without the embedding when confidence_with_markov is off), computed in fp32.

Training lays the blocks over whole rows as DFlash does (`block_forward(..., first=0)`): slot t anchors
[x[t + 1], noise ...] at position t + 1; query i proposes x[t + 2 + i] with the true x[t + 1 + i] (the
shifted batch's input_ids[t + i]) as its previous token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spec_cli.draft.config import DraftConfig
from spec_cli.draft.dflash.model import DFlashDraft
from spec_cli.errors import ConfigError


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(
            self.markov_w1.weight, std=0.01
        )  # a near-zero bias at the start (as speculators)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DSparkDraft(DFlashDraft):
    def __init__(self, config: DraftConfig):
        rank = markov_rank(config)
        if rank < 1:
            raise ConfigError(
                f"a DSpark draft needs a Markov rank of 1 or more (vLLM always builds the Markov "
                f"head), the config says {rank}",
                "train with --markov-rank 1 or more",
            )
        config.extra.setdefault("confidence_head", True)
        # (no head: no Markov input to it either, as the exports say)
        config.extra["confidence_with_markov"] = bool(
            config.extra.get("confidence_with_markov", True) and config.extra["confidence_head"]
        )
        super().__init__(
            config
        )  # (DFlash's checks: the noise token, no EAGLE-3.1 options, blocks of 2 or more)
        self.markov_head = MarkovHead(config.vocab_size, config.draft_vocab_size, rank)
        self.confidence_head = None
        if config.extra["confidence_head"]:
            width = config.hidden_size + (rank if config.extra["confidence_with_markov"] else 0)
            self.confidence_head = ConfidenceHead(width)

    @property
    def with_markov(self) -> bool:
        return bool(self.config.extra["confidence_with_markov"])

    def markov_embed(self, previous: torch.Tensor) -> torch.Tensor:
        """[...] target ids -> [..., r]."""
        return self.markov_head.markov_w1(previous)

    def biased_logits(self, hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """[..., H] final states and [..., r] Markov embeddings of the previous tokens -> [..., Vd]."""
        return self.lm_head(hidden) + self.markov_head.markov_w2(embed)

    def confidence_logit(self, hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """[..., H], [..., r] -> [...] the confidence head's logit in fp32, as vLLM runs the head (fp32
        weights on fp32 inputs), whatever the autocast or FSDP2's bf16 gather of the weights."""
        x = torch.cat([hidden, embed], -1) if self.with_markov else hidden
        proj = self.confidence_head.proj
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), proj.weight.float(), proj.bias.float())[..., 0]


def markov_rank(config: DraftConfig) -> int:
    return int(config.extra.get("markov_rank", 0))
