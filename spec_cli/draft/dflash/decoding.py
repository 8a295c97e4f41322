"""DFlash drafting during speculative decoding, as vLLM's DFlashProposer runs it: the slots the target
just verified add their context keys and values to the draft's cache (their TRUE aux states), then ONE
draft forward over [the newest token, depth masks] at the positions after them proposes the chain; the
block's own keys never enter the cache (vLLM overwrites those slots with the context once the target
has verified them), so the loop's crop has nothing to take back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_cli.draft.decoding import Proposal, probs
from spec_cli.draft.dflash.model import DFlashDraft
from spec_cli.draft.layers import KVCache
from spec_cli.errors import ConfigError


@dataclass
class Newest:
    """The newest verified token and its position (the block's first slot)."""

    token: torch.Tensor  # [] target id
    position: int


def catch_up(draft: DFlashDraft, cache: KVCache, ids: torch.Tensor, aux: torch.Tensor) -> Newest:
    """ids [m] (x[i + 1] for the new slots i), aux [m, n*H_t] (the target's states at i): slots i become
    context; the block starts at the last of ids, one position after the last slot."""
    start, m = len(cache), ids.numel()
    positions = torch.arange(start, start + m, device=ids.device)[None]
    draft.add_context(aux[None], positions, cache)
    return Newest(ids[-1], start + m)


def propose(
    draft: DFlashDraft,
    cache: KVCache,
    state: Newest,
    depth: int,
    topk: int,
    num_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
) -> Proposal:
    """A chain of `depth` tokens from one block forward (greedy, or each sampled from its own q)."""
    if topk > 1:
        raise ConfigError(
            "a DFlash draft proposes a chain (one block per forward), not a tree",
            "evaluate it with --topk 1",
        )
    if depth > draft.block_size - 1:
        raise ConfigError(
            f"this DFlash draft was trained on blocks of {draft.block_size} tokens, so it proposes "
            f"at most {draft.block_size - 1} per forward, not {depth}",
            f"pass --depth {draft.block_size - 1} or less",
        )
    device = state.token.device
    ids = torch.cat([state.token.view(1), draft.mask_ids((depth,), device)])[None]  # [1, depth + 1]
    positions = torch.arange(state.position, state.position + depth + 1, device=device)[None]
    logits = draft.logits(draft.draft_block(ids, positions, cache)[0, 1:]).float()  # [depth, Vd]
    if temperature == 0:
        drafted, qs = logits.argmax(-1), None
    else:
        q = probs(logits, temperature)
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
