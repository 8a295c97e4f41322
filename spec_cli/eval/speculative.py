"""Speculative decoding with an EAGLE-style draft, batch size 1, in short functions (after gpt-fast's `speculative_decode`).

Indexing. x[0..n-1] are the tokens so far (prompt, then output). The target's cache holds x[0..n-2]:
the newest token x[n-1] goes into the next verification. a[i] [3*H_t] are the target's aux states at
position i (outputs of the aux layers). Draft slot i reads (x[i+1], project(a[i])) at rope position i
and its state predicts x[i+2], exactly as in training (the ids are shifted left, the aux states stay).
So once the target has verified up to x[n-1], the draft catches up to slot n-2, whose state proposes
x[n]; a deeper draft step at slot n-2+j reads its own proposal with the state that proposed it.

One step of the loop (`generate`):
    catch_up   run the draft on the slots the target just produced aux states for (its TRUE states)
    draft      chain: `depth` proposals, each fed back for the next; tree: EAGLE-2 top-k expansion
               (both are the draft algorithm's: `Algorithm.catch_up` / `.propose`, spec_cli/draft/decoding.py)
    verify     ONE target forward over [x[n-1], proposals] (tree: ancestor mask, position = n-1+depth)
    accept     the longest path the target agrees with, then one token of the target's own (bonus)
    commit     the target cache keeps the accepted path, the draft cache drops everything it drafted

Verification rules (each emitted token is distributed as the target's next-token distribution p):
    greedy     temperature 0: walk the proposal while the target's argmax is a child; bonus = argmax.
    chain      temperature > 0, draft x_j drawn from q_j: accept x_j with prob min(1, p_j(x_j)/q_j(x_j));
               at the first rejection emit a token from norm(max(p_j - q_j, 0)) and stop; after all k,
               a bonus token from p_{k+1}. (Leviathan et al. 2023, Chen et al. 2023.) Which q depends on
               Settings.draft_sampling:
                 greedy   the draft's argmax, so q_j is a point mass on x_j: accept with prob p_j(x_j),
                          on rejection emit from p_j without x_j (vLLM's default, draft_sample_method
                          "greedy": its rejection sampler runs without draft probs, i.e. q = one-hot)
                 sampled  x_j ~ q_j, the draft's distribution at the temperature (vLLM's
                          draft_sample_method "probabilistic", which passes q to its rejection sampler)
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

from spec_cli.draft import algorithms
from spec_cli.draft.decoding import Proposal, probs
from spec_cli.eval.target import Target, tree_attention
from spec_cli.generation import TOP_LOGITS, Generation


@dataclass
class Settings:
    depth: int = 3  # draft steps per verification (the tree's depth)
    topk: int = 1  # 1: a chain; > 1: an EAGLE-2 tree expanding top-k nodes per depth
    num_tokens: int = 0  # tree: drafted nodes verified per step (0: all); chain: depth
    temperature: float = 0.0  # 0: greedy
    draft_sampling: str = (
        "greedy"  # temperature > 0, a chain: "greedy" argmax drafts (q one-hot, as vLLM's
    )
    #                                 default) or "sampled" from the draft's q (see the docstring)
    adaptive: float = (
        0.0  # > 0: verify a chain's positions while the running product of the draft's
    )
    #                        confidences stays at least this (adaptive verification); 0: all of them
    max_new_tokens: int = 256
    eos_ids: frozenset[int] = frozenset()

    @property
    def tree(self) -> bool:
        return self.topk > 1

    @property
    def draft_temperature(self) -> float:
        """The temperature the draft proposes at: 0 (argmax) unless its drafts are sampled."""
        return self.temperature if self.draft_sampling == "sampled" and not self.tree else 0.0


DRAFT_SAMPLING = ("greedy", "sampled")
# How a drafted token is accepted, by the name the reports give it (eval.json: settings.acceptance_rule).
ACCEPTANCE_RULES = {
    "target-argmax": "accepted while it is the target's argmax (temperature 0)",
    "target-prob": "the draft's argmax, accepted with probability p_target(token); on rejection a token from "
    "p_target without it (q one-hot: vLLM's default, draft_sample_method greedy)",
    "prob-ratio": "sampled from the draft's q, accepted with probability min(1, p_target/q); on rejection a "
    "token from norm(max(p_target - q, 0)) (vLLM's draft_sample_method probabilistic)",
    "tree-target-prob": "the draft's top-k children, y ~ p_target accepted when it is one of them (q one-hot "
    "on each child in turn)",
}


def decoding_rule(settings: Settings) -> dict:
    """How this decoder drafts and accepts, for the reports: {"draft_sampling", "acceptance_rule"}."""
    if settings.temperature == 0:
        return {"draft_sampling": "greedy", "acceptance_rule": "target-argmax"}
    if settings.tree:
        return {"draft_sampling": "greedy", "acceptance_rule": "tree-target-prob"}
    if settings.draft_sampling == "sampled":
        return {"draft_sampling": "sampled", "acceptance_rule": "prob-ratio"}
    return {"draft_sampling": "greedy", "acceptance_rule": "target-prob"}


def eos_ids(tokenizer, generation_config) -> frozenset[int]:
    """The ids that end a turn: the tokenizer's eos and the generation config's (either may be a list)."""
    ids = {tokenizer.eos_token_id}
    extra = getattr(generation_config, "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    return frozenset(int(i) for i in ids if i is not None)


# ----------------------------------------------------------------------------- sampling


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn from the probabilities p [V]."""
    return int(torch.multinomial(p, 1, generator=generator))


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's own choice from its logits [V]: argmax, or a sample at the temperature."""
    if temperature == 0:
        return int(logits.argmax())
    return sample(probs(logits, temperature), generator)


# ----------------------------------------------------------------------------- the target


def prefill(target: Target, cache, prompt: torch.Tensor, images: dict | None = None):
    """The prompt [P] through the target: (logits of the last position [V], aux states [P, 3*H_t]).
    `images`: an image prompt's image inputs (data.vlm.ImagePrompt), their features in place."""
    positions = torch.arange(prompt.numel(), device=prompt.device)[None]
    logits, aux = target.forward(prompt[None], positions, cache, last_only=True, images=images)
    return logits[-1], aux


def verify(target: Target, cache, root: torch.Tensor, proposal: Proposal):
    """ONE target forward over [root, proposal.tokens] ([N + 1]) at positions past + depth, where past =
    the cache length; a tree attends its ancestors only. Returns (logits [N + 1, V], aux [N + 1, 3*H_t]):
    row 0 predicts the token after the root, row i + 1 the token after node i."""
    past = Target.cache_length(cache)
    ids = torch.cat([root.view(1), proposal.tokens])[None]  # [1, N + 1]
    positions = (past + torch.cat([proposal.depths.new_zeros(1), proposal.depths]))[
        None
    ]  # [1, N + 1]
    mask = None if proposal.chain else tree_attention(proposal.parents, past)
    return target.forward(ids, positions, cache, tree_mask=mask)


def accept(
    proposal: Proposal, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """(accepted node indices, root to leaf, the token emitted after them). logits [N + 1, V]."""
    if temperature > 0 and proposal.chain:
        return accept_sampled_chain(proposal, logits, temperature, generator)
    path, node = [], -1  # -1: the root, row 0
    while True:
        y = next_token(
            logits[node + 1], temperature, generator
        )  # argmax, or y ~ p (see the docstring)
        child = ((proposal.parents == node) & (proposal.tokens == y)).nonzero()
        if child.numel() == 0:
            return path, y
        node = int(child[0, 0])
        path.append(node)


def accept_sampled_chain(
    proposal: Proposal, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Speculative sampling over a chain. p: target probs, q: the draft probs x_j was drawn from; an
    argmax draft has none: q is a point mass on x_j, so it is accepted with prob p(x_j)."""
    p = probs(logits, temperature)  # [k + 1, V]
    q = proposal.q  # [k, V]
    if q is None:  # argmax drafts: one-hot q (vLLM's rejection sampler without draft probs)
        q = torch.nn.functional.one_hot(proposal.tokens, p.shape[-1]).to(p.dtype)
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
    new = new[: settings.max_new_tokens]
    for i, t in enumerate(new):
        if t in settings.eos_ids:
            return new[: i + 1]
    return new


@torch.no_grad()
def generate(
    target: Target,
    draft,
    prompt: list[int],
    settings: Settings,
    generator: torch.Generator | None = None,
    algorithm=None,
) -> Generation:
    """Speculative decoding of one prompt with `draft` (a module of its algorithm, default: the one its
    config names); the output is distributed as the target's own decoding (token for token the same
    under greedy)."""
    start = time.perf_counter()
    algorithm = algorithm or algorithms.get(draft.config.algorithm)
    device = next(draft.parameters()).device
    target.capture = True
    t_cache, d_cache = target.new_cache(), draft.new_cache()
    logits, pending = prefill(
        target,
        t_cache,
        torch.tensor(prompt, device=device),  # pending [P, 3*H_t]
        getattr(prompt, "images", None),
    )
    tokens = list(prompt) + [next_token(logits, settings.temperature, generator)]
    steps, drafts, confidence, appended = [], [], [], tokens[-1:]
    draft_seconds = 0.0
    while not _finished(appended, len(tokens) - len(prompt), settings):
        n = len(tokens)  # target cache: x[0..n-2]; draft cache: slots 0..n-2-len(pending)
        new_ids = torch.tensor(
            tokens[n - len(pending) :], device=device
        )  # x[i+1] for the pending slots i
        t0 = _clock(device)
        state = algorithm.catch_up(draft, d_cache, new_ids, pending)  # draft cache: slots 0..n-2
        proposal = algorithm.propose(
            draft,
            d_cache,
            state,
            settings.depth,
            settings.topk,
            settings.num_tokens,
            settings.draft_temperature,
            generator,
        )
        if proposal.confidence is not None and settings.adaptive > 0:
            survival = torch.cumprod(proposal.confidence.float(), 0)
            proposal = proposal.first(
                int((survival >= settings.adaptive).sum())
            )  # survival only falls
        draft_seconds += _clock(device) - t0
        d_cache.crop(
            n - 1
        )  # drafted slots go; the accepted ones are re-run with the target's aux states
        logits, aux = verify(target, t_cache, new_ids[-1], proposal)  # [N + 1, V], [N + 1, 3*H_t]
        path, bonus = accept(proposal, logits, settings.temperature, generator)
        rows = [0] + [i + 1 for i in path]  # the root and the accepted nodes
        target.keep(t_cache, n - 1, rows)  # target cache: x[0..n-1+len(path)]
        pending = aux[rows]
        appended = proposal.tokens[path].tolist() + [bonus]
        tokens += appended
        last = path[-1] if path else -1
        verified = len(path) + int(
            bool((proposal.parents == last).any())
        )  # a child of the last was tried
        steps.append((len(path), verified))
        drafts.append(proposal.tokens.tolist())
        if proposal.confidence is not None:
            confidence.append(proposal.confidence[:verified].tolist())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Generation(
        tokens=_cut(tokens[len(prompt) :], settings),
        seconds=time.perf_counter() - start,
        steps=steps,
        drafts=drafts,
        draft_seconds=draft_seconds,
        confidence=confidence,
    )


@torch.no_grad()
def verify_costs(
    target: Target, prompt: list[int], sizes: list[int], repeats: int = 5
) -> dict[int, float]:
    """Seconds of one target forward over n tokens (a verification of n - 1 drafts), for each n in
    `sizes`, after the prompt's prefill, the tokens taken back each time: the median of `repeats`,
    the sizes interleaved so that a change in the machine's load hits all. -> {n: seconds}."""
    device = target.model.device
    cache = target.new_cache()
    prefill(target, cache, torch.tensor(prompt, device=device), getattr(prompt, "images", None))
    past = Target.cache_length(cache)
    ids = torch.tensor(prompt, device=device)[-1:].repeat(max(sizes))[None]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):  # the first round warms up
        for n in sizes:
            t0 = _clock(device)
            target.forward(ids[:, :n], torch.arange(past, past + n, device=device)[None], cache)
            times[n].append(_clock(device) - t0)
            target.keep(cache, past, [])
    return {n: sorted(t[1:])[len(t[1:]) // 2] for n, t in times.items()}


def _clock(device: torch.device) -> float:
    """perf_counter after the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def generate_target(
    target: Target, prompt: list[int], settings: Settings, generator: torch.Generator | None = None
) -> Generation:
    """The baseline: the target alone, one token per forward, with its KV cache."""
    start = time.perf_counter()
    device = target.model.device
    target.capture = False
    cache = target.new_cache(rollback=False)  # the model's own: nothing is ever taken back
    row, _ = prefill(
        target, cache, torch.tensor(prompt, device=device), getattr(prompt, "images", None)
    )  # [V]
    greedy = settings.temperature == 0
    new, top, keeping = [], [], 0.0
    while True:
        if (
            greedy
        ):  # the choice and the logits nearest it (for report.parting; not timed as decoding)
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
    return Generation(
        tokens=_cut(new, settings), seconds=time.perf_counter() - start - keeping, top=top
    )
