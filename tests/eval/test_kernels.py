"""The evaluator's CPU kernel choice (spec_cli/eval/kernels.py): each linear layer runs oneDNN's packed
weights exactly at the token counts where it was timed faster, gives the logits PyTorch's own linear
gives (to fp32 rounding), keeps greedy speculative decoding equal to the target's own greedy output, and
goes back to nn.Linear on restore."""

import pytest
import torch
from torch import nn

from spec_cli.eval import kernels
from spec_cli.eval import speculative as spec
from spec_cli.eval.target import Target
from tests.eval import greedy, make_draft, peaky_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def model(tiny_llama_dir):
    return peaky_target(tiny_llama_dir)


def rigged(packed_wins: set[int]):
    """A clock under which the packed kernel is faster at these row counts only (times: [plain, packed])."""
    calls = []

    def median_ms(fn):
        calls.append(fn)
        packed_turn = len(calls) % 2 == 0  # choose() times the default, then the packed kernel, per count
        n = rigged.rows[(len(calls) - 1) // 2 % len(rigged.rows)]
        return (0.5 if n in packed_wins else 2.0) if packed_turn else 1.0
    return median_ms


def test_each_layer_runs_packed_exactly_at_the_counts_where_it_was_faster(model, monkeypatch):
    rigged.rows = [1, 2, 3, 4]
    monkeypatch.setattr(kernels, "_median_ms", rigged({4}))
    ran = []
    real = kernels._run_packed
    monkeypatch.setattr(kernels, "_run_packed", lambda *a: ran.append(a[0].shape) or real(*a))
    choice = kernels.choose(model, [1, 2, 3, 4])
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert choice.modules == len(linears) and all(v == [4] for v in choice.packed.values())
    assert set(choice.milliseconds) == {f"{m.out_features}x{m.in_features}" for m in linears}
    ran.clear()
    with torch.no_grad():
        ids = torch.randint(0, model.config.vocab_size, (1, 4))
        packed_logits = model(input_ids=ids).logits
        assert len(ran) == len(linears)  # 4 tokens: every layer on the packed weights
        ran.clear()
        model(input_ids=ids[:, :3])
        assert ran == []  # 3 tokens: PyTorch's own
    kernels.restore(model)
    assert not any("forward" in m.__dict__ or "_spec_packed" in m.__dict__ for m in linears)
    with torch.no_grad():
        torch.testing.assert_close(packed_logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_a_kernel_no_faster_than_the_margin_is_not_chosen(model, monkeypatch):
    rigged.rows = [1, 2]
    monkeypatch.setattr(kernels, "_median_ms", lambda fn: 1.0)  # a tie: noise must not flip choices
    choice = kernels.choose(model, [1, 2])
    assert choice.packed == {} and choice.modules == 0
    assert "PyTorch's default kernel at 1,2 tokens" in choice.text()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_greedy_speculative_decoding_on_packed_layers_is_the_targets_greedy_output(model, monkeypatch):
    """Every count of a chain of 3 (1..4 tokens) on packed weights: the output is still the target's own."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (8,), generator=g).tolist()
    reference = greedy(model, prompt, 16)
    rigged.rows = [1, 2, 3, 4]
    monkeypatch.setattr(kernels, "_median_ms", rigged({1, 2, 3, 4}))
    kernels.choose(model, [1, 2, 3, 4])
    draft = make_draft(model)
    target = Target(model, draft.config.aux_layer_ids)
    try:
        settings = spec.Settings(depth=3, max_new_tokens=16)
        out = spec.generate(target, draft, prompt, settings)
        alone = spec.generate_target(target, prompt, settings)
    finally:
        target.close()
    assert out.tokens == reference[:16] and alone.tokens == reference[:16]


def test_packed_copies_stay_within_the_memory_given(model, monkeypatch):
    """Every shape saves the same per layer here, so the smallest weights save the most per byte and go
    first; with room for exactly their copies, only they are packed; with none, nothing is."""
    rigged.rows = [1, 4]
    monkeypatch.setattr(kernels, "_median_ms", rigged({1, 4}))
    groups = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            groups.setdefault(f"{m.out_features}x{m.in_features}", []).append(m)
    first = min(groups, key=lambda name: groups[name][0].weight.numel())
    size = sum(m.weight.numel() * m.weight.element_size() for m in groups[first])
    choice = kernels.choose(model, [1, 4], memory=int(size / kernels.MEMORY_SHARE) + 1)
    assert list(choice.packed) == [first] and choice.modules == len(groups[first])
    assert set(choice.skipped) == set(groups) - {first} and "not packed for lack of memory" in choice.text()
    assert sum("_spec_packed" in m.__dict__ for m in model.modules()) == len(groups[first])
    kernels.restore(model)
    rigged.rows = [1, 4]
    monkeypatch.setattr(kernels, "_median_ms", rigged({1, 4}))
    assert kernels.choose(model, [1, 4], memory=0).packed == {}


def test_a_shape_onednn_refuses_keeps_pytorchs_kernel(model, monkeypatch):
    """Where oneDNN will not pack (bf16 on a CPU without AVX-512 BW/VL/DQ: "bf16 path needs the cpu
    support avx_ne_convert or avx512bw, avx512vl and avx512dq"), that shape stays plain, and says why."""
    def refuse(weight):
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq")
    monkeypatch.setattr(kernels, "_packed", refuse)
    choice = kernels.choose(model, [1, 2])
    assert choice.packed == {} and choice.modules == 0
    assert all("bf16 path needs" in why for why in choice.refused.values()) and choice.refused
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert kernels._dtypes() == (torch.float32,)


def test_a_subclass_or_an_existing_override_keeps_its_forward(model, monkeypatch):
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)
    model.lm_head.__class__ = Scaled
    hooked = model.model.layers[0].mlp.down_proj
    hooked.forward = lambda x: x  # (as accelerate's hooks replace forward on the instance)
    rigged.rows = [1]
    monkeypatch.setattr(kernels, "_median_ms", rigged({1}))
    kernels.choose(model, [1])
    assert "_spec_packed" not in model.lm_head.__dict__ and "forward" not in model.lm_head.__dict__
    assert "_spec_packed" not in hooked.__dict__
    kernels.restore(model)
    assert "forward" in hooked.__dict__  # not taken away by restore


def test_the_counts_timed_cover_every_chain_the_eval_decodes(model, monkeypatch):
    """A chain of d verifies d + 1 tokens: --compare-depths deeper than --depth are timed too; a tree its
    nodes plus the root; --kernels plain times nothing."""
    from pathlib import Path

    from spec_cli.stages import eval as evaluate

    asked = []
    monkeypatch.setattr(kernels, "choose", lambda m, rows: asked.append(rows) or kernels.KernelChoice(rows))
    cfg = evaluate.EvalConfig(target="t", draft=Path("d"), depth=2, compare_depths=(3, 1))
    assert evaluate.linear_kernels(cfg, model, spec.Settings(depth=2))["mode"] == "auto"
    evaluate.linear_kernels(evaluate.EvalConfig(target="t", draft=Path("d"), compare_depths="auto"), model,
                            spec.Settings(depth=3))
    evaluate.linear_kernels(cfg, model, spec.Settings(depth=3, topk=2, num_tokens=8))
    assert asked == [[1, 2, 3, 4], [1, 2, 3, 4], list(range(1, 10))]
    plain = evaluate.linear_kernels(evaluate.EvalConfig(target="t", draft=Path("d"), kernels="plain"), model,
                                    spec.Settings())
    assert plain == {"mode": "plain", "why": "--kernels plain"} and len(asked) == 3


def test_not_on_another_device(model):
    assert kernels.supported(model) is None
    assert "meta" in kernels.supported(model.to("meta"))
