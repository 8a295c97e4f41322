"""P-EAGLE drafting during speculative decoding, as vLLM's `parallel_drafting` runs it: ONE draft
forward per cycle over the slots the target just verified (their true aux states) and depth - 1 mask
slots after them; the newest slot proposes token 1, mask slot j token j + 1. The mask slots' keys
leave the cache again with the loop's crop (spec_cli/eval/speculative.py), like a chain's drafts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_cli.draft.decoding import Proposal, probs
from spec_cli.draft.layers import KVCache
from spec_cli.draft.peagle.model import PEagleDraft
from spec_cli.errors import ConfigError


@dataclass
class Pending:
    """The verified slots not yet run (catch_up defers them to the one forward of `propose`)."""

    ids: torch.Tensor  # [m] x[i + 1] for the slots i
    aux: torch.Tensor  # [m, 3*H_t] the target's aux states at those slots


def catch_up(draft: PEagleDraft, cache: KVCache, ids: torch.Tensor, aux: torch.Tensor) -> Pending:
    return Pending(ids, aux)


def propose(
    draft: PEagleDraft,
    cache: KVCache,
    state: Pending,
    depth: int,
    topk: int,
    num_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
) -> Proposal:
    """A chain of `depth` tokens from one forward (greedy, or each sampled from its own q)."""
    if topk > 1:
        raise ConfigError(
            "a P-EAGLE draft proposes a chain (all depths in one forward), not a tree",
            "evaluate it with --topk 1",
        )
    device = state.ids.device
    start, m = len(cache), state.ids.numel()
    masks = depth - 1
    ids = torch.cat([state.ids, draft.mask_ids(masks, device)])[None]  # [1, m + depth - 1]
    hidden = torch.cat(
        [draft.project(state.aux[None]), draft.mask_state().expand(1, masks, -1)], dim=1
    )
    positions = torch.arange(start, start + m + masks, device=device)[None]
    states = draft.forward_step(ids, hidden, positions, cache)[0, m - 1 :]  # [depth, H]
    logits = draft.logits(states).float()  # [depth, Vd]
    if temperature == 0:
        drafted, qs = logits.argmax(-1), None
    else:
        q = probs(logits, temperature)  # [depth, Vd]
        drafted = torch.multinomial(q, 1, generator=generator)[:, 0]
        selected = draft.to_target_ids(torch.arange(draft.config.draft_vocab_size, device=device))
        qs = torch.zeros(depth, draft.config.vocab_size, device=device).index_copy_(1, selected, q)
    return Proposal(
        tokens=draft.to_target_ids(drafted),
        parents=torch.arange(depth, device=device) - 1,
        depths=torch.arange(1, depth + 1, device=device),
        q=qs,
        chain=True,
    )
