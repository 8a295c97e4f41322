"""Speculative decoding on a tiny random Llama: greedy == the target's greedy token for token (chains
and trees, random / fitted / oracle drafts), exact acceptance accounting, the draft fed exactly what
training feeds it, and tree drafting that matches running the draft along each path."""

import copy

import pytest
import torch

from spec_cli.draft import decoding
from spec_cli.draft.eagle3 import EAGLE3
from spec_cli.draft.eagle3 import implementation as eagle3_code
from spec_cli.draft.layers import KVCache
from spec_cli.eval import speculative as spec
from spec_cli.eval.report import Tally
from spec_cli.eval.target import Target
from tests.eval import OracleDraft, fitted_draft, greedy, make_draft, peaky_target

CHAINS = [(1, 1, 0), (2, 1, 0), (3, 1, 0), (4, 1, 0)]  # depth, topk, tree nodes (0: all)
TREES = [(3, 3, 8), (4, 2, 0)]
N_NEW = 20


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tiny_llama_dir):
    model = peaky_target(tiny_llama_dir)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(2)]
    refs = [greedy(model, p, N_NEW + 6) for p in prompts]
    fit_prompts = [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(8)] + prompts
    drafts = {
        "random": make_draft(model),
        "fitted": fitted_draft(model, fit_prompts, n=24),
        "oracle": [
            make_draft(model, cls=OracleDraft, reference=p + r, wrong=frozenset(range(0, 200, 5)))
            for p, r in zip(prompts, refs)
        ],
    }
    target = Target(model, drafts["random"].config.aux_layer_ids)
    return {"model": model, "target": target, "prompts": prompts, "refs": refs, "drafts": drafts}


@pytest.mark.parametrize(
    "kind,shapes",
    [
        ("random", [(1, 1, 0), (3, 1, 0), (3, 3, 8)]),
        ("fitted", CHAINS + TREES),
        ("oracle", CHAINS + TREES),
    ],
)
def test_greedy_is_the_targets_greedy_token_for_token(world, kind, shapes):
    accepted = {}  # shape -> drafts accepted per step
    for depth, topk, nodes in shapes:
        for i, (prompt, ref) in enumerate(zip(world["prompts"], world["refs"])):
            draft = world["drafts"][kind][i] if kind == "oracle" else world["drafts"][kind]
            settings = spec.Settings(depth=depth, topk=topk, num_tokens=nodes, max_new_tokens=N_NEW)
            out = spec.generate(world["target"], draft, prompt, settings)
            assert out.tokens == ref[:N_NEW], (kind, depth, topk, i)
            assert all(0 <= m <= v <= depth for m, v in out.steps)
            accepted.setdefault((depth, topk), []).extend(m for m, _ in out.steps)
    if kind != "random":  # the test has teeth: multi-token acceptances in chains and trees
        assert max(accepted[(4, 1)]) >= 2 and max(accepted[(3, 3)]) >= 2, accepted
        mean = {shape: sum(m) / len(m) for shape, m in accepted.items()}
        assert mean[(3, 3)] > mean[(1, 1)] and mean[(3, 3)] > 0.3, mean


def test_target_alone_and_eos(world):
    target, prompt, ref = world["target"], world["prompts"][0], world["refs"][0]
    base = spec.generate_target(target, prompt, spec.Settings(max_new_tokens=N_NEW))
    assert base.tokens == ref[:N_NEW] and base.steps == []
    eos = ref[5]
    cut = ref[: ref.index(eos) + 1]
    settings = spec.Settings(depth=3, max_new_tokens=N_NEW, eos_ids=frozenset({eos}))
    assert spec.generate_target(target, prompt, settings).tokens == cut
    assert spec.generate(target, world["drafts"]["oracle"][0], prompt, settings).tokens == cut


@pytest.mark.parametrize("depth,topk", [(1, 1), (3, 1), (4, 1), (3, 2)])
def test_exact_draft_accepts_everything(world, depth, topk):
    """A draft that proposes exactly the target's continuation: every step produces depth + 1 tokens."""
    model, prompt, ref = world["model"], world["prompts"][1], world["refs"][1]
    oracle = make_draft(model, cls=OracleDraft, reference=prompt + greedy(model, prompt, 40))
    settings = spec.Settings(depth=depth, topk=topk, num_tokens=0, max_new_tokens=N_NEW)
    out = spec.generate(world["target"], oracle, prompt, settings)
    assert out.tokens == ref[:N_NEW]
    assert out.steps == [(depth, depth)] * -(
        -(N_NEW - 1) // (depth + 1)
    )  # the prefill gave token 1
    assert out.acceptance_length == depth + 1
    tally = Tally()
    tally.add(out, None)
    assert tally.metrics()["acceptance_rate"] == [1.0] * depth


def test_acceptance_accounting_on_a_constructed_case(world):
    """The oracle is wrong at every 5th token index: the accepted counts follow by hand."""
    model, prompt = world["model"], world["prompts"][1]
    depth, wrong = 3, frozenset(range(0, 200, 5))
    oracle = make_draft(
        model, cls=OracleDraft, reference=prompt + greedy(model, prompt, 40), wrong=wrong
    )
    out = spec.generate(
        world["target"], oracle, prompt, spec.Settings(depth=depth, max_new_tokens=N_NEW)
    )
    expected, n = (
        [],
        len(prompt) + 1,
    )  # n: tokens so far; the step proposes token indices n, n+1, ...
    while n - len(prompt) < N_NEW:
        m = 0
        while m < depth and n + m not in wrong:
            m += 1
        expected.append((m, min(m + 1, depth)))
        n += m + 1
    assert out.steps == expected
    tally = Tally()
    tally.add(out, spec.Generation(tokens=out.tokens, seconds=out.seconds))
    metrics = tally.metrics()
    assert metrics["acceptance_length"] == sum(m + 1 for m, _ in expected) / len(expected)
    for j in range(depth):
        verified = sum(v > j for _, v in expected)
        assert metrics["verified"][j] == verified
        assert metrics["acceptance_rate"][j] == sum(m > j for m, _ in expected) / verified
    assert metrics["same_as_target"] == 1 and metrics["speedup"] == pytest.approx(1.0, rel=1e-3)


def test_draft_reads_what_training_feeds_it(world, monkeypatch):
    """Over a whole generation the draft catches up on (x[i+1], a[i]) for i = 0, 1, ... in order, with the
    target's TRUE aux states a[i] (as a full forward gives them), and its states equal the training
    forward's (Eagle3Draft.forward, step 0 of TTT)."""
    target, draft, prompt = world["target"], world["drafts"]["fitted"], world["prompts"][0]
    calls = []

    def recording(draft_, cache, ids, aux):
        calls.append((len(cache), ids.clone(), aux.clone()))
        return decoding.catch_up(draft_, cache, ids, aux)

    monkeypatch.setattr(eagle3_code, "catch_up", recording)  # what EAGLE3.catch_up loads
    out = spec.generate(
        target,
        draft,
        prompt,
        spec.Settings(depth=3, topk=2, num_tokens=5, max_new_tokens=N_NEW),
        algorithm=EAGLE3,
    )
    seq = torch.tensor(prompt + out.tokens)
    starts = [c[0] for c in calls]
    sizes = [c[1].numel() for c in calls]
    assert starts == [sum(sizes[:i]) for i in range(len(calls))]  # contiguous slots from 0
    ids, aux = torch.cat([c[1] for c in calls]), torch.cat([c[2] for c in calls])
    T = ids.numel()
    assert torch.equal(ids, seq[1 : T + 1])
    full = world["model"](input_ids=seq[None, :T], output_hidden_states=True)
    true_aux = torch.cat([full.hidden_states[i + 1] for i in draft.config.aux_layer_ids], -1)[0]
    torch.testing.assert_close(aux, true_aux, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        trained = draft(seq[None, 1 : T + 1], true_aux[None])[
            0, -1
        ]  # [H] training forward, last slot
        decoded = decoding.catch_up(
            draft, _cache_after(draft, ids[: T // 2], aux[: T // 2]), ids[T // 2 :], aux[T // 2 :]
        )
    torch.testing.assert_close(decoded[0, 0], trained, rtol=1e-4, atol=1e-4)


def _cache_after(draft, ids, aux) -> KVCache:
    cache = KVCache(len(draft.decoder_layers))
    decoding.catch_up(draft, cache, ids, aux)
    return cache


@torch.no_grad()
def test_tree_nodes_are_top_k_of_the_draft_run_along_their_path(world):
    """Every tree node is one of the top-k of the draft run sequentially (plain causal cache) along the
    node's path: the tree mask shows a node its ancestors only, at positions by depth."""
    model, draft, prompt = world["model"], world["drafts"]["random"], world["prompts"][1]
    draft = copy.deepcopy(draft)
    with torch.no_grad():
        draft.lm_head.weight.mul_(8.0)  # decided, not near-tied, top-k
    seq = torch.tensor(prompt)
    full = model(input_ids=seq[None], output_hidden_states=True)
    aux = torch.cat([full.hidden_states[i + 1] for i in draft.config.aux_layer_ids], -1)[0]
    cache = _cache_after(draft, seq[1:], aux[:-1])
    state = _last_state(draft, seq[1:], aux[:-1])
    depth, k = 4, 3
    tree = decoding.draft_tree(draft, cache, state, depth, k, num_tokens=0)
    assert tree.tokens.numel() == k + (depth - 1) * k * k
    assert len(cache) == len(prompt) - 1 + (depth - 1) * k  # the frontier's slots were appended
    for i in range(tree.tokens.numel()):
        path = [i]
        while tree.parents[path[-1]] >= 0:
            path.append(int(tree.parents[path[-1]]))
        path = path[::-1]  # root's child first
        assert tree.depths[i] == len(path)
        c = _cache_after(draft, seq[1:], aux[:-1])
        s = state
        for j, node in enumerate(path[:-1]):  # feed the ancestors one by one
            s = draft.forward_step(
                tree.tokens[node].view(1, 1), s, torch.tensor([[len(prompt) - 1 + j]]), c
            )
        top = draft.to_target_ids(draft.logits(s[0, -1]).topk(k).indices)
        assert int(tree.tokens[i]) in top.tolist(), i
    chain = decoding.draft_chain(
        draft, _cache_after(draft, seq[1:], aux[:-1]), state, depth, 0.0, None
    )
    line = decoding.draft_tree(
        draft, _cache_after(draft, seq[1:], aux[:-1]), state, depth, 1, num_tokens=0
    )
    assert torch.equal(chain.tokens, line.tokens) and torch.equal(chain.parents, line.parents)


def _last_state(draft, ids, aux):
    return decoding.catch_up(draft, KVCache(len(draft.decoder_layers)), ids, aux)


def test_target_alone_keeps_its_best_logits_per_token(world):
    """top holds the real logits of the target's own decoding (a plain forward over the same tokens)."""
    prompt = world["prompts"][0]
    out = spec.generate_target(world["target"], prompt, spec.Settings(max_new_tokens=N_NEW))
    assert len(out.top) == len(out.tokens) == N_NEW
    with torch.no_grad():
        logits = (
            world["model"](torch.tensor([prompt + out.tokens]))
            .logits[0, len(prompt) - 1 : -1]
            .float()
        )
    values, ids = logits.topk(spec.TOP_LOGITS, dim=-1)
    for i, kept in enumerate(out.top):
        assert list(kept) == ids[i].tolist() and out.tokens[i] == int(ids[i, 0])
        assert list(kept.values()) == pytest.approx(values[i].tolist(), abs=1e-4)
    sampled = spec.generate_target(
        world["target"],
        prompt,
        spec.Settings(max_new_tokens=4, temperature=1.0),
        torch.Generator().manual_seed(0),
    )
    assert sampled.top == []  # kept for greedy only (ties mean nothing when sampling)
