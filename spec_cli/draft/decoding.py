"""Drafting during speculative decoding, for a draft that decodes one slot at a time over the
target's states (EAGLE-3's aux states, EAGLE-1/2's final hidden state): catch up on them, then
propose a chain or an EAGLE-2 tree. `spec_cli/eval/speculative.py` verifies and accepts.

The draft is any module with `project(aux)`, `forward_step(ids, state, positions, cache, mask=None)`,
`logits(state)`, `to_target_ids(draft_ids)` and a `config` (vocab_size, draft_vocab_size); the
indexing of slots and positions is spelled out in speculative.py's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_cli.draft.layers import KVCache


@dataclass
class Proposal:
    """Drafted tokens as a tree over the root (the newest committed token); a chain is a path."""

    tokens: torch.Tensor  # [N] target ids, parents before children
    parents: torch.Tensor  # [N] parent node index, -1 = the root
    depths: torch.Tensor  # [N] 1 = a child of the root
    q: torch.Tensor | None = (
        None  # [N, V] the draft distribution each token was sampled from (chain)
    )
    chain: bool = True
    confidence: torch.Tensor | None = (
        None  # [N] the draft's own P(accepted | the ones before accepted)
    )

    def first(self, k: int) -> Proposal:
        """The chain's first k tokens (adaptive verification verifies no more)."""
        cut = lambda x: None if x is None else x[:k]  # noqa: E731
        return Proposal(
            self.tokens[:k],
            self.parents[:k],
            self.depths[:k],
            cut(self.q),
            self.chain,
            cut(self.confidence),
        )


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[..., V] logits -> probabilities (fp32) at this temperature (> 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def catch_up(draft, cache: KVCache, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Draft slots len(cache) .. len(cache)+m-1 read (ids [m], project(aux [m, 3*H_t])), the target's
    true aux states. Returns the last slot's state [1, 1, H]: its logits propose the next token."""
    start, m = len(cache), ids.numel()
    positions = torch.arange(start, start + m, device=ids.device)[None]  # [1, m]
    state = draft.forward_step(ids[None], draft.project(aux[None]), positions, cache)  # [1, m, H]
    return state[:, -1:]


def draft_chain(
    draft,
    cache: KVCache,
    state: torch.Tensor,
    depth: int,
    temperature: float,
    generator: torch.Generator | None,
) -> Proposal:
    """`depth` tokens, each from the state of the previous draft step (greedy, or sampled from q at
    the temperature). state [1, 1, H]: the state of slot len(cache) - 1, which read the newest token."""
    pos = len(cache)  # slot of the first proposal when it is fed back
    selected = draft.to_target_ids(torch.arange(draft.config.draft_vocab_size, device=state.device))
    tokens, qs = [], []
    for j in range(depth):
        if j:  # feed the previous proposal, with the state that proposed it, one position on
            positions = torch.full((1, 1), pos + j - 1, device=state.device)
            state = draft.forward_step(tokens[-1].view(1, 1), state, positions, cache)  # [1, 1, H]
        logits = draft.logits(state[0, -1]).float()  # [Vd]
        if temperature == 0:
            d = logits.argmax()
        else:
            q = probs(logits, temperature)  # [Vd]
            d = torch.multinomial(q, 1, generator=generator)[0]
            qs.append(
                torch.zeros(draft.config.vocab_size, device=q.device).index_copy_(0, selected, q)
            )
        tokens.append(draft.to_target_ids(d))
    k = len(tokens)
    return Proposal(
        tokens=torch.stack(tokens),
        parents=torch.arange(k, device=state.device) - 1,
        depths=torch.arange(1, k + 1, device=state.device),
        q=torch.stack(qs) if qs else None,
        chain=True,
    )


def draft_tree(
    draft, cache: KVCache, state: torch.Tensor, depth: int, topk: int, num_tokens: int
) -> Proposal:
    """EAGLE-2 dynamic tree. Score of a node = cumulative draft log-prob of its path. Depth 1: the root's
    top-k. Then per depth: feed the k best nodes of the last depth (the frontier) in one draft forward
    (each attends the committed slots, its ancestors' slots and itself), take the top-k children of
    each (k*k candidates) and keep the k best as the next frontier. Finally keep the `num_tokens` best
    nodes of all (a child never scores above its parent, so the set contains every kept node's path)."""
    device = state.device
    k, L0 = topk, len(cache)  # slot L0 - 1 read the newest token: it is the root's
    logp = torch.log_softmax(draft.logits(state[0, -1]).float(), dim=-1)  # [Vd]
    score, ids = logp.topk(k)  # [k]
    scores, tokens, parents = [score], [ids], [torch.full((k,), -1, device=device)]
    frontier = torch.arange(k, device=device)  # node indices of the last depth's k best
    hidden = state.expand(1, k, -1)  # [1, k, H] the state that proposed each frontier node
    seen = torch.zeros(
        k, 0, dtype=torch.bool, device=device
    )  # [k, fed]: drafted slots each frontier node sees
    for d in range(2, depth + 1):
        eye = torch.eye(k, dtype=torch.bool, device=device)
        mask = torch.cat([torch.ones(k, L0, dtype=torch.bool, device=device), seen, eye], dim=1)
        positions = torch.full(
            (1, k), L0 - 1 + d - 1, device=device
        )  # depth d-1 nodes, fed at depth d
        node_ids = draft.to_target_ids(torch.cat(tokens)[frontier])[None]  # [1, k]
        states = draft.forward_step(
            node_ids, hidden, positions, cache, mask[None, None]
        )  # [1, k, H]
        logp = torch.log_softmax(draft.logits(states[0]).float(), dim=-1)  # [k, Vd]
        child_score, child_ids = (torch.cat(scores)[frontier][:, None] + logp).topk(
            k, dim=-1
        )  # [k, k]
        first = sum(s.numel() for s in scores)  # index of the first new node
        scores.append(child_score.flatten())
        tokens.append(child_ids.flatten())
        parents.append(frontier.repeat_interleave(k))
        best = child_score.flatten().topk(k).indices  # [k] of the k*k candidates
        frontier = first + best
        hidden = states[:, best // k]  # [1, k, H]
        seen = torch.cat([seen, eye], dim=1)[
            best // k
        ]  # a child sees what its parent saw, and the parent
    scores, tokens, parents = torch.cat(scores), torch.cat(tokens), torch.cat(parents)
    depths = torch.cat(
        [torch.full((k,), 1, device=device)]
        + [torch.full((k * k,), d, device=device) for d in range(2, depth + 1)]
    )
    # best first; ties go to the shallower node, so a parent always precedes its children
    order = torch.sort(depths, stable=True).indices
    order = order[torch.sort(scores[order], descending=True, stable=True).indices]
    keep = (
        order[: num_tokens or None].sort().values
    )  # kept nodes in creation order: parents before children
    new_index = torch.full_like(scores, -1, dtype=torch.long)
    new_index[keep] = torch.arange(keep.numel(), device=device)
    kept_parents = parents[keep]
    kept_parents = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], -1)
    if bool((kept_parents[depths[keep] > 1] < 0).any()):
        raise RuntimeError(
            "draft tree: a kept node lost its parent"
        )  # cannot happen: see the docstring
    return Proposal(
        tokens=draft.to_target_ids(tokens[keep]),
        parents=kept_parents,
        depths=depths[keep],
        chain=False,
    )


def propose(
    draft,
    cache: KVCache,
    state: torch.Tensor,
    depth: int,
    topk: int,
    num_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
) -> Proposal:
    """A chain (topk 1: `depth` tokens, greedy or sampled) or an EAGLE-2 tree (topk > 1, greedy scores)."""
    if topk > 1:
        return draft_tree(draft, cache, state, depth, topk, num_tokens)
    return draft_chain(draft, cache, state, depth, temperature, generator)
