"""What `spec eval` reports, from known counts: acceptance length and rate by position, tokens/s,
speed-up and its per-turn spread (eval.json's fields), and the table printed from them."""

import io
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from spec_cli import console as console_mod
from spec_cli.eval.report import Tally, print_table, spread, spread_text, turn_speedup
from spec_cli.eval.speculative import Generation

# two turns; each step is (drafts accepted, deepest position verified on the accepted path)
SPEC = [
    Generation(tokens=list(range(9)), seconds=1.0, steps=[(2, 3), (0, 1), (3, 3)]),
    Generation(tokens=[5, 6], seconds=0.5, steps=[(1, 2)]),
]
BASE = [Generation(tokens=list(range(9)), seconds=2.0), Generation(tokens=[5, 7], seconds=0.5)]


def tally(positions: int = 3) -> Tally:
    t = Tally(positions=positions)
    for spec, base in zip(SPEC, BASE):
        t.add(spec, base)
    return t


def test_metrics_from_known_counts():
    m = tally().metrics()
    # by hand: 4 forwards produced 3 + 1 + 4 + 2 tokens; position 1 verified by all 4, accepted by 3;
    # position 2 verified by (2,3), (3,3), (1,2), accepted by the first two; position 3: 2 and 1
    assert (m["turns"], m["target_forwards"], m["tokens_produced"]) == (2, 4, 10)
    assert m["acceptance_length"] == 2.5
    assert (m["verified"], m["accepted"]) == ([4, 3, 2], [3, 2, 1])
    assert m["acceptance_rate"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert (m["spec_tokens"], m["spec_seconds"], m["target_tokens"], m["target_seconds"]) == (
        11,
        1.5,
        11,
        2.5,
    )
    assert m["spec_tokens_per_s"] == pytest.approx(11 / 1.5) and m[
        "target_tokens_per_s"
    ] == pytest.approx(4.4)
    assert m["speedup"] == pytest.approx((11 / 1.5) / (11 / 2.5))
    assert m["same_as_target"] == 1  # the second turn's output differs from the target's
    # per turn: (9 / 1.0) / (9 / 2.0) = 2.0 and (2 / 0.5) / (2 / 0.5) = 1.0
    assert m["speedup_spread"] == {
        "turns": 2,
        "median": 1.5,
        "q1": 1.25,
        "q3": 1.75,
        "min": 1.0,
        "max": 2.0,
    }


def test_positions_never_verified_are_reported_as_none():
    m = tally(positions=5).metrics()
    assert m["verified"] == [4, 3, 2, 0, 0]
    assert m["acceptance_rate"][3:] == [None, None]
    assert Tally().metrics()["acceptance_length"] == 0.0 and Tally().metrics()["speedup"] == 0.0


def test_turn_speedup_needs_tokens_and_time_on_both_sides():
    assert turn_speedup(SPEC[0], BASE[0]) == 2.0
    assert turn_speedup(Generation(tokens=[], seconds=1.0), BASE[0]) is None
    assert turn_speedup(SPEC[0], Generation(tokens=[1], seconds=0.0)) is None


def test_spread_is_numpys_percentiles():
    values = [1.3, 0.7, 2.2, 1.1, 0.9, 1.6, 1.05]
    s = spread(values)
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    assert (s["q1"], s["median"], s["q3"]) == pytest.approx((q1, median, q3))
    assert (s["min"], s["max"], s["turns"]) == (0.7, 2.2, 7)
    assert spread([1.4]) == {
        "turns": 1,
        "median": 1.4,
        "q1": 1.4,
        "q3": 1.4,
        "min": 1.4,
        "max": 1.4,
    }
    assert spread([]) is None
    assert (
        spread_text(spread([1.0, 2.0]))
        == "median 1.50x, middle half 1.25-1.75x, range 1.00-2.00x over 2 turns"
    )
    assert spread_text(spread([1.4])).endswith("over 1 turn") and spread_text(None) == ""


@pytest.fixture
def printed(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(console_mod, "console", Console(file=out, width=200))
    monkeypatch.setattr(console_mod, "_quiet", False)
    return out


def result(**settings):
    overall = tally(positions=4).metrics()
    one = Tally(positions=4)
    one.add(SPEC[0], BASE[0])
    return SimpleNamespace(
        draft="runs/d",
        target_name="tiny",
        json_path="e/eval.json",
        plot_path="e/acc.png",
        settings={"depth": 3, "topk": 1, "num_tokens": None, "temperature": 0, **settings},
        overall=overall,
        categories={"writing": one.metrics(), "coding": overall},
        busy=None,
    )


def test_the_table_shows_each_category_and_the_totals(printed):
    print_table(result(threads=2, threads_reason="the cores this process may use"))
    text = printed.getvalue()
    assert "spec eval: runs/d on tiny (chain of 3, greedy)" in text
    rows = [
        line.replace("\u2502", " ").split() for line in text.splitlines()
    ]  # cells without the box lines
    lines = {row[0]: row for row in rows if row and row[0] in ("writing", "coding", "all")}
    # category, turns, accept len, spec tok/s, target tok/s, speed-up, per turn (middle half)
    assert lines["all"][1:] == ["2", "2.50", "7.3", "4.4", "1.67x", "1.25-1.75"]
    assert lines["writing"][1:] == ["1", "2.67", "9.0", "4.5", "2.00x", "2.00-2.00"]
    assert (
        "acceptance rate by draft position (given the ones before were accepted): 1: 0.75  2: 0.67  "
        "3: 0.50  4: -" in text
    )
    assert "greedy outputs identical to the target's: 1/2 turns" in text
    assert (
        "timing: 2 threads (the cores this process may use); each turn timed once per decoder"
        in text
    )
    assert "WARNING" not in text and "written: e/eval.json, e/acc.png" in text


def test_a_tree_sampled_on_a_busy_machine_says_so(printed):
    r = result(topk=4, num_tokens=16, temperature=0.7)
    r.busy = {"warning": "the machine was busy"}
    print_table(r)
    text = printed.getvalue()
    assert "(tree depth 3, top-4, 16 nodes, sampling T=0.7)" in text
    assert "greedy outputs" not in text and "WARNING: the machine was busy" in text


def test_quiet_prints_nothing(printed, monkeypatch):
    monkeypatch.setattr(console_mod, "_quiet", True)
    print_table(result())
    assert printed.getvalue() == ""
