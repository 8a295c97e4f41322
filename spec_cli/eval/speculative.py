"""EAGLE-3 speculative decoding, batch size 1, in short functions (after gpt-fast's `speculative_decode`).

Indexing. x[0..n-1] are the tokens so far (prompt, then output). The target's cache holds x[0..n-2]:
the newest token x[n-1] goes into the next verification. a[i] [3*H_t] are the target's aux states at
position i (outputs of the aux layers). Draft slot i reads (x[i+1], project(a[i])) at rope position i
and its state predicts x[i+2], exactly as in training (the ids are shifted left, the aux states stay).
So once the target has verified up to x[n-1], the draft catches up to slot n-2, whose state proposes
x[n]; a deeper draft step at slot n-2+j reads its own proposal with the state that proposed it.

One step of the loop (`generate`):
    catch_up   run the draft on the slots the target just produced aux states for (its TRUE states)
    draft      chain: `depth` proposals, each fed back for the next; tree: EAGLE-2 top-k expansion
    verify     ONE target forward over [x[n-1], proposals] (tree: ancestor mask, position = n-1+depth)
    accept     the longest path the target agrees with, then one token of the target's own (bonus)
    commit     the target cache keeps the accepted path, the draft cache drops everything it drafted

Verification rules (each emitted token is distributed as the target's next-token distribution p):
    greedy     temperature 0: walk the proposal while the target's argmax is a child; bonus = argmax.
    chain      temperature > 0, draft x_j sampled from q_j: accept x_j with prob min(1, p_j(x_j)/q_j(x_j));
               at the first rejection emit a token from norm(max(p_j - q_j, 0)) and stop; after all k,
               a bonus token from p_{k+1}. (Leviathan et al. 2023, Chen et al. 2023.)
    tree       temperature > 0: the children are the draft's top-k, not samples, so q is a point mass on
               each child in turn; rejecting child c with prob 1 - p(c) and renormalising p without it
               (the chain rule with q = delta_c), over all children, is the same as: sample y ~ p; if y
               is a child, accept it and continue from it; else emit y and stop. That is what `accept`
               does (EAGLE's evaluate_posterior for sampling), and it is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from spec_cli.draft.model import Eagle3Draft, KVCache
from spec_cli.eval.target import Target, tree_attention
from spec_cli.generation import TOP_LOGITS, Generation


@dataclass
class Settings:
    depth: int = 3  # draft steps per verification (the tree's depth)
    topk: int = 1  # 1: a chain; > 1: an EAGLE-2 tree expanding top-k nodes per depth
    num_tokens: int = 0  # tree: drafted nodes verified per step (0: all); chain: depth
    temperature: float = 0.0  # 0: greedy
    max_new_tokens: int = 256
    eos_ids: frozenset[int] = frozenset()

    @property
    def tree(self) -> bool:
        return self.topk > 1


def eos_ids(tokenizer, generation_config) -> frozenset[int]:
    """The ids that end a turn: the tokenizer's eos and the generation config's (either may be a list)."""
    ids = {tokenizer.eos_token_id}
    extra = getattr(generation_config, "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    return frozenset(int(i) for i in ids if i is not None)


@dataclass
class Proposal:
    """Drafted tokens as a tree over the root (the newest committed token); a chain is a path."""
    tokens: torch.Tensor  # [N] target ids, parents before children
    parents: torch.Tensor  # [N] parent node index, -1 = the root
    depths: torch.Tensor  # [N] 1 = a child of the root
    q: torch.Tensor | None = None  # [N, V] the draft distribution each token was sampled from (chain)
    chain: bool = True


# ----------------------------------------------------------------------------- sampling

def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[..., V] logits -> probabilities (fp32) at this temperature (> 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn from the probabilities p [V]."""
    return int(torch.multinomial(p, 1, generator=generator))


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's own choice from its logits [V]: argmax, or a sample at the temperature."""
    if temperature == 0:
        return int(logits.argmax())
    return sample(probs(logits, temperature), generator)


# ----------------------------------------------------------------------------- the draft

def catch_up(draft: Eagle3Draft, cache: KVCache, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Draft slots len(cache) .. len(cache)+m-1 read (ids [m], project(aux [m, 3*H_t])), the target's
    true aux states. Returns the last slot's state [1, 1, H]: its logits propose the next token."""
    start, m = len(cache), ids.numel()
    positions = torch.arange(start, start + m, device=ids.device)[None]  # [1, m]
    state = draft.forward_step(ids[None], draft.project(aux[None]), positions, cache)  # [1, m, H]
    return state[:, -1:]


def draft_chain(draft: Eagle3Draft, cache: KVCache, state: torch.Tensor, depth: int,
                temperature: float, generator: torch.Generator | None) -> Proposal:
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
            qs.append(torch.zeros(draft.config.vocab_size, device=q.device).index_copy_(0, selected, q))
        tokens.append(draft.to_target_ids(d))
    k = len(tokens)
    return Proposal(tokens=torch.stack(tokens), parents=torch.arange(k, device=state.device) - 1,
                    depths=torch.arange(1, k + 1, device=state.device),
                    q=torch.stack(qs) if qs else None, chain=True)


def draft_tree(draft: Eagle3Draft, cache: KVCache, state: torch.Tensor, depth: int, topk: int,
               num_tokens: int) -> Proposal:
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
    seen = torch.zeros(k, 0, dtype=torch.bool, device=device)  # [k, fed]: drafted slots each frontier node sees
    for d in range(2, depth + 1):
        eye = torch.eye(k, dtype=torch.bool, device=device)
        mask = torch.cat([torch.ones(k, L0, dtype=torch.bool, device=device), seen, eye], dim=1)
        positions = torch.full((1, k), L0 - 1 + d - 1, device=device)  # depth d-1 nodes, fed at depth d
        node_ids = draft.to_target_ids(torch.cat(tokens)[frontier])[None]  # [1, k]
        states = draft.forward_step(node_ids, hidden, positions, cache, mask[None, None])  # [1, k, H]
        logp = torch.log_softmax(draft.logits(states[0]).float(), dim=-1)  # [k, Vd]
        child_score, child_ids = (torch.cat(scores)[frontier][:, None] + logp).topk(k, dim=-1)  # [k, k]
        first = sum(s.numel() for s in scores)  # index of the first new node
        scores.append(child_score.flatten())
        tokens.append(child_ids.flatten())
        parents.append(frontier.repeat_interleave(k))
        best = child_score.flatten().topk(k).indices  # [k] of the k*k candidates
        frontier = first + best
        hidden = states[:, best // k]  # [1, k, H]
        seen = torch.cat([seen, eye], dim=1)[best // k]  # a child sees what its parent saw, and the parent
    scores, tokens, parents = torch.cat(scores), torch.cat(tokens), torch.cat(parents)
    depths = torch.cat([torch.full((k,), 1, device=device)]
                       + [torch.full((k * k,), d, device=device) for d in range(2, depth + 1)])
    # best first; ties go to the shallower node, so a parent always precedes its children
    order = torch.sort(depths, stable=True).indices
    order = order[torch.sort(scores[order], descending=True, stable=True).indices]
    keep = order[:num_tokens or None].sort().values  # kept nodes in creation order: parents before children
    new_index = torch.full_like(scores, -1, dtype=torch.long)
    new_index[keep] = torch.arange(keep.numel(), device=device)
    kept_parents = parents[keep]
    kept_parents = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], -1)
    if bool((kept_parents[depths[keep] > 1] < 0).any()):
        raise RuntimeError("draft tree: a kept node lost its parent")  # cannot happen: see the docstring
    return Proposal(tokens=draft.to_target_ids(tokens[keep]), parents=kept_parents, depths=depths[keep],
                    chain=False)


# ----------------------------------------------------------------------------- the target

def prefill(target: Target, cache, prompt: torch.Tensor):
    """The prompt [P] through the target: (logits of the last position [V], aux states [P, 3*H_t])."""
    positions = torch.arange(prompt.numel(), device=prompt.device)[None]
    logits, aux = target.forward(prompt[None], positions, cache, last_only=True)
    return logits[-1], aux


def verify(target: Target, cache, root: torch.Tensor, proposal: Proposal):
    """ONE target forward over [root, proposal.tokens] ([N + 1]) at positions past + depth, where past =
    the cache length; a tree attends its ancestors only. Returns (logits [N + 1, V], aux [N + 1, 3*H_t]):
    row 0 predicts the token after the root, row i + 1 the token after node i."""
    past = Target.cache_length(cache)
    ids = torch.cat([root.view(1), proposal.tokens])[None]  # [1, N + 1]
    positions = (past + torch.cat([proposal.depths.new_zeros(1), proposal.depths]))[None]  # [1, N + 1]
    mask = None if proposal.chain else tree_attention(proposal.parents, past)
    return target.forward(ids, positions, cache, tree_mask=mask)


def accept(proposal: Proposal, logits: torch.Tensor, temperature: float,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """(accepted node indices, root to leaf, the token emitted after them). logits [N + 1, V]."""
    if temperature > 0 and proposal.chain:
        return accept_sampled_chain(proposal, logits, temperature, generator)
    path, node = [], -1  # -1: the root, row 0
    while True:
        y = next_token(logits[node + 1], temperature, generator)  # argmax, or y ~ p (see the docstring)
        child = ((proposal.parents == node) & (proposal.tokens == y)).nonzero()
        if child.numel() == 0:
            return path, y
        node = int(child[0, 0])
        path.append(node)


def accept_sampled_chain(proposal: Proposal, logits: torch.Tensor, temperature: float,
                         generator: torch.Generator | None) -> tuple[list[int], int]:
    """Speculative sampling over a chain. p: target probs, q: the draft probs x_j was sampled from."""
    p = probs(logits, temperature)  # [k + 1, V]
    q = proposal.q  # [k, V]
    for j, x in enumerate(proposal.tokens.tolist()):
        # q(x) >= p(x): accept with prob p(x)/q(x); q(x) < p(x): always
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[j, x] < p[j, x]:
            continue
        residual = (p[j] - q[j]).clamp_min(0)  # rejected: the mass p has beyond q
        if float(residual.sum()) <= 0:  # p == q up to rounding: nothing beyond q; p is the same law
            residual = p[j]
        return list(range(j)), sample(residual / residual.sum(), generator)
    return list(range(len(proposal.tokens))), sample(p[-1], generator)  # all accepted: bonus from p


# ----------------------------------------------------------------------------- the loop

def _finished(appended: list[int], generated: int, settings: Settings) -> bool:
    """Stop once max_new_tokens are out or one of the tokens just appended is an eos."""
    return generated >= settings.max_new_tokens or any(t in settings.eos_ids for t in appended)


def _cut(new: list[int], settings: Settings) -> list[int]:
    """The output: up to the first eos (kept), at most max_new_tokens."""
    new = new[:settings.max_new_tokens]
    for i, t in enumerate(new):
        if t in settings.eos_ids:
            return new[:i + 1]
    return new


@torch.no_grad()
def generate(target: Target, draft: Eagle3Draft, prompt: list[int], settings: Settings,
             generator: torch.Generator | None = None) -> Generation:
    """Speculative decoding of one prompt; the output is distributed as the target's own decoding
    (token for token the same under greedy)."""
    start = time.perf_counter()
    device = draft.fc.weight.device
    target.capture = True
    t_cache, d_cache = target.new_cache(), KVCache(len(draft.decoder_layers))
    logits, pending = prefill(target, t_cache, torch.tensor(prompt, device=device))  # pending [P, 3*H_t]
    tokens = list(prompt) + [next_token(logits, settings.temperature, generator)]
    steps, drafts, appended = [], [], tokens[-1:]
    while not _finished(appended, len(tokens) - len(prompt), settings):
        n = len(tokens)  # target cache: x[0..n-2]; draft cache: slots 0..n-2-len(pending)
        new_ids = torch.tensor(tokens[n - len(pending):], device=device)  # x[i+1] for the pending slots i
        state = catch_up(draft, d_cache, new_ids, pending)  # draft cache: slots 0..n-2
        if settings.tree:
            proposal = draft_tree(draft, d_cache, state, settings.depth, settings.topk, settings.num_tokens)
        else:
            proposal = draft_chain(draft, d_cache, state, settings.depth, settings.temperature, generator)
        d_cache.crop(n - 1)  # drafted slots go; the accepted ones are re-run with the target's aux states
        logits, aux = verify(target, t_cache, new_ids[-1], proposal)  # [N + 1, V], [N + 1, 3*H_t]
        path, bonus = accept(proposal, logits, settings.temperature, generator)
        rows = [0] + [i + 1 for i in path]  # the root and the accepted nodes
        target.keep(t_cache, n - 1, rows)  # target cache: x[0..n-1+len(path)]
        pending = aux[rows]
        appended = proposal.tokens[path].tolist() + [bonus]
        tokens += appended
        last = path[-1] if path else -1
        verified = len(path) + int(bool((proposal.parents == last).any()))  # a child of the last was tried
        steps.append((len(path), verified))
        drafts.append(proposal.tokens.tolist())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Generation(tokens=_cut(tokens[len(prompt):], settings), seconds=time.perf_counter() - start,
                      steps=steps, drafts=drafts)


@torch.no_grad()
def generate_target(target: Target, prompt: list[int], settings: Settings,
                    generator: torch.Generator | None = None) -> Generation:
    """The baseline: the target alone, one token per forward, with its KV cache."""
    start = time.perf_counter()
    device = target.model.device
    target.capture = False
    cache = target.new_cache(rollback=False)  # the model's own: nothing is ever taken back
    row, _ = prefill(target, cache, torch.tensor(prompt, device=device))  # [V]
    greedy = settings.temperature == 0
    new, top, keeping = [], [], 0.0
    while True:
        if greedy:  # the choice and the logits nearest it (for report.parting; not timed as decoding)
            t0 = time.perf_counter()
            values, ids = row.topk(min(TOP_LOGITS, row.numel()))
            top.append(dict(zip(ids.tolist(), values.tolist())))
            keeping += time.perf_counter() - t0
        new.append(next_token(row, settings.temperature, generator))
        if _finished(new[-1:], len(new), settings):
            break
        position = torch.full((1, 1), len(prompt) + len(new) - 1, device=device)
        logits, _ = target.forward(torch.tensor([[new[-1]]], device=device), position, cache)
        row = logits[-1]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    target.capture = True
    return Generation(tokens=_cut(new, settings), seconds=time.perf_counter() - start - keeping, top=top)
