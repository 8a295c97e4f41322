"""Speculative decoding past every attention window: prompt + output (60 tokens) run far past the
window (8) of Mistral (every layer sliding), Gemma 3 (sliding + full), Llama 4 (chunked + full) and
plain Llama; drafts are rejected there (the cache must take tokens back). Greedy output, chain and
tree, sdpa and eager, is the target's own greedy decoding (transformers' generate) token for token."""

import pytest
import torch
from transformers import DynamicCache

from spec_cli.errors import ConfigError
from spec_cli.eval import speculative as spec
from spec_cli.eval.target import Target
from tests import windowed
from tests.eval import OracleDraft, greedy, make_draft

PROMPT, N_NEW = 20, 40
WRONG = frozenset({23, 26, 27, 31, 38, 41, 42, 47, 53, 55})  # token indices the oracle gets wrong
SHAPES = [(3, 1, 0), (4, 1, 0), (3, 2, 0), (4, 3, 8)]  # depth, topk, tree nodes (0: all)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(
    scope="module",
    params=[
        ("mistral", "sdpa"),
        ("gemma3", "sdpa"),
        ("gemma3", "eager"),
        ("llama4", "sdpa"),
        ("llama", "sdpa"),
    ],
    ids=lambda p: "-".join(p),
)
def world(request):
    arch, attention = request.param
    model = windowed.model(arch, 256, head_scale=40.0)
    model.config._attn_implementation = attention  # the decoder reads it at each forward
    prompt = torch.randint(5, 256, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = greedy(model, prompt, N_NEW)
    oracle = make_draft(
        model, cls=OracleDraft, aux=windowed.AUX, reference=prompt + ref, wrong=WRONG
    )
    return {
        "model": model,
        "target": Target(model, windowed.AUX),
        "prompt": prompt,
        "ref": ref,
        "oracle": oracle,
        "random": make_draft(model, aux=windowed.AUX),
    }


@pytest.mark.parametrize("depth,topk,nodes", SHAPES)
def test_greedy_past_the_window_is_the_targets_greedy(world, depth, topk, nodes):
    settings = spec.Settings(depth=depth, topk=topk, num_tokens=nodes, max_new_tokens=N_NEW)
    out = spec.generate(world["target"], world["oracle"], world["prompt"], settings)
    assert out.tokens == world["ref"]
    accepted = [m for m, _ in out.steps]
    assert max(accepted) == depth and min(accepted) < depth  # long acceptances, and rejections
    random = spec.generate(world["target"], world["random"], world["prompt"], settings)
    assert random.tokens == world["ref"]


def test_the_baseline_keeps_the_models_own_cache(world):
    """The target alone decodes with transformers' own cache (sliding layers hold their window only)."""
    target = world["target"]
    out = spec.generate_target(target, world["prompt"], spec.Settings(max_new_tokens=N_NEW))
    assert out.tokens == world["ref"]
    own = [type(layer) for layer in DynamicCache(config=world["model"].config).layers]
    assert [type(layer) for layer in target.new_cache(rollback=False).layers] == own


def test_a_target_whose_layers_keep_a_state_is_refused():
    model = windowed.model("qwen3next", 256)
    target = Target(model, windowed.AUX)
    with pytest.raises(ConfigError, match="linear_attention layers keep a state"):
        spec.generate(
            target, make_draft(model, aux=windowed.AUX), [5, 6, 7], spec.Settings(max_new_tokens=4)
        )
