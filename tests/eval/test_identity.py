"""How a greedy speculative output that differs from the target's is explained (eval/report.py's
`parting` and the line `spec eval` prints): a flip at a rounding tie of the target's logits, or not."""

import pytest
import torch

from spec_cli.eval.report import Tally, identity_text, parting
from spec_cli.eval.speculative import Generation

BF16, FP32 = torch.finfo(torch.bfloat16).eps, torch.finfo(torch.float32).eps


def target(tokens, top):
    return Generation(tokens=tokens, seconds=1.0, top=top)


def ours(tokens):
    return Generation(tokens=tokens, seconds=1.0, steps=[(0, 1)] * len(tokens))


# the target wrote 5, 7, 9; at index 1 it chose 7 (logit 20.0); 8 and 3 came next
def top(logit_of_8, logit_of_3=15.0):
    return [{5: 30.0, 1: 10.0}, {7: 20.0, 8: logit_of_8, 3: logit_of_3}, {9: 25.0, 2: 3.0}]


def test_identical_outputs_have_no_parting():
    assert parting(ours([5, 7, 9]), target([5, 7, 9], top(19.0)), BF16) is None


@pytest.mark.parametrize(
    "logit_of_8, eps, tie",
    [
        (20.0, BF16, True),  # an exact tie
        (19.875, BF16, True),  # one bf16 ulp at 20 (0.125)
        (18.8, BF16, True),  # 1.2 <= 8 ulps * 20 = 1.25
        (18.7, BF16, False),  # 1.3: more than rounding in bf16
        (19.9995, FP32, True),  # within fp32's floor (1e-3)
        (19.99, FP32, False),  # 0.01 is no fp32 rounding
    ],
)
def test_a_flip_is_a_tie_only_within_rounding(logit_of_8, eps, tie):
    got = parting(ours([5, 8, 1]), target([5, 7, 9], top(logit_of_8)), eps)
    assert got["at"] == 1 and got["target"] == 7 and got["spec"] == 8
    assert got["margin"] == pytest.approx(20.0 - logit_of_8)
    assert got["tie"] is tie


def test_a_three_way_tie_counts_and_so_do_equal_logits_in_any_order():
    # ours was the target's third best, 0.125 below its choice (seen on SmolLM2 in bf16)
    got = parting(ours([5, 3]), target([5, 7], top(19.9, logit_of_3=19.875)), BF16)
    assert got["tie"] is True and got["margin"] == pytest.approx(0.125)
    # equal logits: argmax took 7 though the dict lists 8 first
    got = parting(ours([5, 8]), target([5, 7], [{5: 30.0}, {8: 19.25, 7: 19.25}]), BF16)
    assert got["tie"] is True and got["margin"] == 0.0


def test_a_token_outside_the_targets_best_logits_is_never_a_tie():
    got = parting(ours([5, 4, 1]), target([5, 7, 9], top(20.0)), BF16)
    assert got["at"] == 1 and got["margin"] is None and got["tie"] is False


def test_without_the_targets_logits_the_cause_is_unknown():
    got = parting(ours([5, 8]), target([5, 7], []), BF16)  # e.g. vLLM's decoders keep no logits
    assert got["at"] == 1 and got["tie"] is None


def test_the_line_counts_ties_and_warns_about_the_rest():
    tally = Tally(3)
    base = target([5, 7, 9], top(19.875))
    for spec_tokens in ([5, 7, 9], [5, 8, 1], [5, 4, 1]):  # identical, a bf16 tie, not a tie
        spec = ours(spec_tokens)
        tally.add(spec, base, parting(spec, base, BF16))
    m = tally.metrics()
    assert (m["same_as_target"], m["parted_at_tie"], m["parted_not_tie"]) == (1, 1, 1)
    assert m["largest_tie_margin"] == pytest.approx(0.125)
    line = identity_text(m, "bfloat16")
    assert line.startswith(
        "greedy outputs identical to the target's: 1/3 turns; 1 more part from it"
    )
    assert "bfloat16 rounding (margin <= 0.125)" in line
    assert "WARNING: 1 part from it where its logits do not tie" in line
    clean = identity_text({"same_as_target": 3, "turns": 3, "parted_at_tie": 0}, "float32")
    assert clean == "greedy outputs identical to the target's: 3/3 turns"
