"""Speculative sampling keeps the target's distribution.

1. The chain rule alone, on fixed p and q: the first emitted token is distributed as p_1, once it is
   accepted the second as p_2, and once both are, the bonus as p_3 (4k trials; a plausible wrong rule,
   resampling from p instead of norm(max(p - q, 0)) after a rejection, fails the same check).
2. End to end on a tiny 8-token Llama: the first four tokens of speculative sampling (a chain of sampled
   drafts, a chain of argmax drafts with q one-hot, a tree) against the target's exact distribution,
   computed from every prefix (token 1 comes from the prefill; tokens 2-4 from the first verifications:
   accepted drafts, residual samples and bonus tokens).
Seeds are fixed and the p-value threshold is 1e-4, so the tests are deterministic and do not flake.
"""

import itertools

import pytest
import torch

from spec_cli.eval import speculative as spec
from spec_cli.eval.target import Target
from tests.eval import make_draft

ALPHA = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


def chi2_pvalue(counts: torch.Tensor, p: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square test of counts [K] against probabilities p [K]; cells expected fewer than
    `min_expected` times are pooled into one."""
    counts, p = counts.double().flatten(), p.double().flatten()
    n = counts.sum()
    small = p * n < min_expected
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        p = torch.cat([p[~small], p[small].sum().view(1)])
    expected = p * n
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


# ----------------------------------------------------------------------------- the rule alone


def _resample_from_p(proposal, logits, temperature, generator):
    """A WRONG rule (after a rejection it samples from p, not from the residual), as a control."""
    p = spec.probs(logits, temperature)
    for j, x in enumerate(proposal.tokens.tolist()):
        if torch.rand((), generator=generator) * proposal.q[j, x] >= p[j, x]:
            return list(range(j)), spec.sample(p[j], generator)
    return list(range(len(proposal.tokens))), spec.sample(p[-1], generator)


@pytest.mark.parametrize("rule,ok", [(spec.accept_sampled_chain, True), (_resample_from_p, False)])
def test_chain_rule_emits_target_distribution(rule, ok):
    p = torch.tensor(
        [
            [0.50, 0.20, 0.15, 0.10, 0.05, 0.00],
            [0.05, 0.05, 0.10, 0.30, 0.40, 0.10],
            [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
        ]
    )  # [k + 1, V] target
    q = torch.tensor(
        [[0.10, 0.40, 0.10, 0.10, 0.10, 0.20], [0.30, 0.05, 0.05, 0.40, 0.10, 0.10]]
    )  # [k, V] draft (a token p never emits too)
    logits = p.clamp_min(1e-30).log()
    g = torch.Generator().manual_seed(0)
    first, second, third = torch.zeros(6), torch.zeros(6), torch.zeros(6)
    for _ in range(4_000):
        tokens = torch.stack([torch.multinomial(q[j], 1, generator=g)[0] for j in range(2)])
        proposal = spec.Proposal(
            tokens=tokens, parents=torch.tensor([-1, 0]), depths=torch.tensor([1, 2]), q=q
        )
        path, y = rule(proposal, logits, 1.0, g)
        emitted = tokens[: len(path)].tolist() + [y]
        first[emitted[0]] += 1
        if len(path) >= 1:  # the first was a draft token: the second is decided in this step too
            second[emitted[1]] += 1
        if len(path) == 2:  # both accepted: the third is the bonus token
            third[emitted[2]] += 1
    pvalues = [chi2_pvalue(first, p[0]), chi2_pvalue(second, p[1]), chi2_pvalue(third, p[2])]
    passed = min(pvalues) > ALPHA
    assert passed == ok
    assert first[5] == 0 or not ok  # never a token the target gives no mass


def test_argmax_drafts_are_accepted_with_the_targets_probability_of_them():
    """Argmax drafts carry no q (Proposal.q None): the rule treats q as one-hot, as vLLM's rejection
    sampler does without draft probs. Then position 1 is accepted with p_1(x_1), both with p_1(x_1) p_2(x_2),
    and a rejected x_1 is replaced by a token from p_1 without x_1; counted over 4k trials against those
    numbers, computed from p alone. And it is the chain rule with an explicit one-hot q, draw for draw."""
    p = torch.tensor(
        [
            [0.50, 0.20, 0.15, 0.10, 0.05, 0.00],
            [0.05, 0.05, 0.10, 0.30, 0.40, 0.10],
            [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
        ]
    )  # [k + 1, V] target
    tokens = torch.tensor(
        [1, 4]
    )  # the draft's argmax at each position (not the target's argmax at 1)
    logits = p.clamp_min(1e-30).log()
    chain = dict(tokens=tokens, parents=torch.tensor([-1, 0]), depths=torch.tensor([1, 2]))
    g = torch.Generator().manual_seed(0)
    lengths, replaced = torch.zeros(3), torch.zeros(6)
    for _ in range(4_000):
        path, y = spec.accept_sampled_chain(spec.Proposal(**chain), logits, 1.0, g)
        lengths[len(path)] += 1
        if not path:
            replaced[y] += 1
    a1, a2 = p[0, 1], p[1, 4]  # accept probabilities: the target's probability of each draft token
    expected = torch.stack([1 - a1, a1 * (1 - a2), a1 * a2])  # P(0, 1, 2 accepted)
    without = p[0].clone()
    without[1] = 0
    assert chi2_pvalue(lengths, expected) > ALPHA, (lengths / 4_000, expected)
    assert chi2_pvalue(replaced, without / without.sum()) > ALPHA
    assert replaced[1] == 0  # never the rejected token itself

    one_hot = torch.nn.functional.one_hot(tokens, 6).float()
    for seed in range(50):
        implicit = spec.accept_sampled_chain(
            spec.Proposal(**chain), logits, 1.0, torch.Generator().manual_seed(seed)
        )
        explicit = spec.accept_sampled_chain(
            spec.Proposal(**chain, q=one_hot), logits, 1.0, torch.Generator().manual_seed(seed)
        )
        assert implicit == explicit


def test_each_draft_sampling_names_its_rule_as_vllm_does():
    """The reports' names: spec_cli's settings and vLLM's config give the same name for the same rule."""
    from spec_cli.eval.session import vllm_rule

    cases = [
        (0.0, "greedy", "greedy", "target-argmax"),
        (0.7, "greedy", "greedy", "target-prob"),
        (0.7, "sampled", "probabilistic", "prob-ratio"),
    ]
    for temperature, ours, theirs, name in cases:
        rule = spec.decoding_rule(spec.Settings(temperature=temperature, draft_sampling=ours))
        assert rule == vllm_rule(
            temperature, {"draft_sample_method": theirs, "rejection_sample_method": "standard"}
        )
        assert rule["acceptance_rule"] == name and name in spec.ACCEPTANCE_RULES
    tree = spec.decoding_rule(spec.Settings(temperature=0.7, topk=2, draft_sampling="sampled"))
    assert tree == {
        "draft_sampling": "greedy",
        "acceptance_rule": "tree-target-prob",
    }  # top-k nodes: never sampled


# ----------------------------------------------------------------------------- end to end

V, N_RUNS, T = 8, 250, 0.8


@pytest.fixture(scope="module")
def small():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked but spread: several tokens carry mass at each step
    # a draft over 6 of the 8 tokens, peaked differently: q is far from p
    draft = make_draft(
        model, selected=torch.tensor([0, 1, 2, 4, 5, 7]), seed=1, head_scale=1.0, aux=[0, 1, 2]
    )
    return model, draft


@torch.no_grad()
def exact_first(model, prompt: list[int], n: int) -> torch.Tensor:
    """P(y1, ..., yn) [V] * n of the target sampling at temperature T, from every prefix."""
    joint = torch.ones(())
    for length in range(n):
        prefixes = torch.tensor(
            list(itertools.product(range(V), repeat=length)), dtype=torch.long
        ).view(V**length, length)  # [V**length, length]
        ids = torch.cat([torch.tensor(prompt).expand(prefixes.shape[0], -1), prefixes], 1)
        p = spec.probs(model(input_ids=ids).logits[:, -1], T)  # [V**length, V]
        joint = joint[..., None] * p.view(*[V] * length, V)
    return joint


@pytest.mark.parametrize(
    "depth,topk,drafts", [(2, 1, "sampled"), (2, 1, "greedy"), (2, 2, "greedy")]
)
def test_speculative_sampling_keeps_target_distribution(small, depth, topk, drafts):
    model, draft = small
    prompt = [3, 1, 6, 2]
    joint = exact_first(model, prompt, 4)  # [V, V, V, V]
    target = Target(model, draft.config.aux_layer_ids)
    settings = spec.Settings(
        depth=depth, topk=topk, num_tokens=0, temperature=T, max_new_tokens=4, draft_sampling=drafts
    )
    counts = torch.zeros(V, V, V, V)
    accepted = 0
    for seed in range(N_RUNS):
        out = spec.generate(target, draft, prompt, settings, torch.Generator().manual_seed(seed))
        counts[tuple(out.tokens)] += 1
        accepted += sum(m for m, _ in out.steps)
    target.close()
    assert accepted > N_RUNS * 0.3  # drafts do get accepted: the rule is exercised, not bypassed
    keep = {"y2": (0, 2, 3), "y3": (0, 1, 3), "y4": (0, 1, 2), "y2y3": (0, 3), "y3y4": (0, 1)}
    pvalues = {name: chi2_pvalue(counts.sum(dims), joint.sum(dims)) for name, dims in keep.items()}
    assert min(pvalues.values()) > ALPHA, pvalues
    tv = 0.5 * float((counts.sum((0, 1, 2)) / N_RUNS - joint.sum((0, 1, 2))).abs().sum())
    assert tv < 0.12, tv
