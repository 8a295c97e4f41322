"""DSpark drafting during speculative decoding, as vLLM's DSparkSpeculator runs it: the verified slots
add their context keys and values (DFlash's catch_up), then ONE block forward over [the newest token,
noise x (depth - 1)] at the positions from the newest token's, and the Markov head samples the chain
left to right: position i's logits are the block's plus the bias of the token before it (the newest
token for i = 0, else the one drafted at i - 1). The confidence head's probability of each position is
returned with the chain (`Proposal.confidence`)."""

from __future__ import annotations

import torch

from spec_cli.draft.decoding import Proposal, probs
from spec_cli.draft.dflash.decoding import Newest, catch_up  # noqa: F401 (the algorithm's catch_up)
from spec_cli.draft.dspark.model import DSparkDraft
from spec_cli.draft.layers import KVCache
from spec_cli.errors import ConfigError


def propose(
    draft: DSparkDraft,
    cache: KVCache,
    state: Newest,
    depth: int,
    topk: int,
    num_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
) -> Proposal:
    """A chain of `depth` tokens from one block forward and the sequential Markov head (greedy, or each
    sampled from its own biased q)."""
    if topk > 1:
        raise ConfigError(
            "a DSpark draft proposes a chain (one block per forward), not a tree",
            "evaluate it with --topk 1",
        )
    if depth > draft.block_size:
        raise ConfigError(
            f"this DSpark draft was trained on blocks of {draft.block_size} tokens, so it proposes "
            f"at most {draft.block_size} per forward, not {depth}",
            f"pass --depth {draft.block_size} or less",
        )
    device = state.token.device
    ids = torch.cat([state.token.view(1), draft.mask_ids((depth - 1,), device)])[None]  # [1, depth]
    positions = torch.arange(state.position, state.position + depth, device=device)[None]
    hidden = draft.draft_block(ids, positions, cache)[
        0
    ]  # [depth, H]: query i proposes position + 1 + i
    base = draft.logits(hidden)  # [depth, Vd]
    selected = draft.to_target_ids(torch.arange(draft.config.draft_vocab_size, device=device))
    previous, tokens, qs, embeds = state.token.view(1), [], [], []
    for i in range(depth):
        embed = draft.markov_embed(previous)  # [1, r]
        logits = (base[i : i + 1] + draft.markov_head.markov_w2(embed)).float()[0]  # [Vd]
        if temperature == 0:
            drafted = logits.argmax()
        else:
            q = probs(logits, temperature)
            drafted = torch.multinomial(q, 1, generator=generator)[0]
            qs.append(
                torch.zeros(draft.config.vocab_size, device=device).index_copy_(0, selected, q)
            )
        previous = draft.to_target_ids(drafted).view(1)
        tokens.append(previous[0])
        embeds.append(embed[0])
    confidence = None
    if draft.confidence_head is not None:
        confidence = torch.sigmoid(draft.confidence_logit(hidden, torch.stack(embeds)))  # [depth]
    return Proposal(
        tokens=torch.stack(tokens),
        parents=torch.arange(depth, device=device) - 1,
        depths=torch.arange(1, depth + 1, device=device),
        q=torch.stack(qs) if qs else None,
        chain=True,
        confidence=confidence,
    )
