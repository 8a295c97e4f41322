"""spec tune: the schedule from what was measured (pure functions), PyTorch's sweep of chains and trees at
batch 1, and what is refused: a busy machine's recommendation, a batch size the KV cache cannot hold, a
missing engine. (vLLM's sweep and the served schedule: tests/engine/test_engine_loop.py.)"""

from __future__ import annotations

import json
import re

import pytest

from spec_cli.cli import main
from spec_cli.errors import ConfigError
from spec_cli.stages import tune
from tests.stages.test_engine_eval import sized  # noqa: F401 (the module fixture: target, data, cache)


@pytest.mark.parametrize(
    "fastest, schedule",
    [
        ({1: 3, 2: 3, 4: 1, 8: 0, 16: 0}, [[1, 3, 3], [4, 7, 1], [8, 16, 0]]),
        ({1: 2}, [[1, 1, 2]]),
        ({1: 0, 4: 2}, [[1, 3, 0], [4, 4, 2]]),
        ({2: 1, 4: 1}, [[1, 4, 1]]),  # the first range starts at 1 (vLLM requires it)
    ],
)
def test_schedule_keeps_each_measured_sizes_k_until_the_next(fastest, schedule):
    assert tune.schedule_for(fastest) == schedule


def test_recommend_takes_the_fastest_median_and_fewer_drafts_on_a_tie():
    m = lambda *tps: tune.Measured(list(tps))  # noqa: E731
    table = {
        1: {"k0": m(10, 11, 12), "k1": m(14, 13, 30), "k2": m(13, 13, 13)},
        8: {"k0": m(50, 50), "k1": m(50, 50), "k2": m(40, 60)},
    }
    assert tune.recommend(table, ["k0", "k1", "k2"]) == {
        1: "k1",
        8: "k0",
    }  # medians 14 > 13 > 11; 50 = 50 = 50


def test_a_parallel_drafters_schedule_holds_one_k_and_none():
    m = lambda tps: tune.Measured([tps])  # noqa: E731
    # fastest per size: k3 at 1, k1 at 4 and 8; a parallel drafter serves 0 and one k only
    table = {
        1: {"target": m(10), "k0": m(9), "k1": m(14), "k2": m(15), "k3": m(16)},
        4: {"target": m(40), "k0": m(38), "k1": m(48), "k2": m(47), "k3": m(30)},
        8: {"target": m(80), "k0": m(78), "k1": m(86), "k2": m(84), "k3": m(60)},
    }
    assert tune.recommend(table, ["k0", "k1", "k2", "k3"]) == {1: "k3", 4: "k1", 8: "k1"}
    # summed speed-ups: k1 1.4 + 1.2 + 1.075 = 3.675; k2 1.5 + 1.175 + 1.05 = 3.725; k3 1.6 + 0.95 + 0.975
    assert tune.recommend_one_k(table, [1, 2, 3]) == {1: "k2", 4: "k2", 8: "k2"}
    table[1]["k2"] = m(13)  # k2's gain drops below k1's: its 0/k1 choices win
    assert tune.recommend_one_k(table, [1, 2, 3]) == {1: "k1", 4: "k1", 8: "k1"}
    slow = {b: {**row, "k1": m(1), "k2": m(1), "k3": m(1)} for b, row in table.items()}
    assert tune.recommend_one_k(slow, [1, 2, 3]) == {1: "k0", 4: "k0", 8: "k0"}


@pytest.mark.parametrize("options, refused", [({"parallel_drafting": True}, [1, 2]), ({}, [])])
def test_a_parallel_drafting_engine_takes_its_own_k_or_none(options, refused):
    """vLLM's parallel drafter fills num_speculative_tokens mask slots whatever k the schedule asks for
    (a shape error at batch 2): the engine refuses k in between, in one line, before vLLM sees it."""
    from types import SimpleNamespace

    from spec_cli.engine import vllm

    scheduler = SimpleNamespace(dynamic_sd_lookup=[0, 3, 3])
    engine = vllm.Engine.__new__(vllm.Engine)  # a started engine's parts, without starting vLLM
    engine.speculative_options = options
    engine.llm = SimpleNamespace(
        llm_engine=SimpleNamespace(
            engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler)),
            vllm_config=SimpleNamespace(
                speculative_config=SimpleNamespace(num_speculative_tokens=3)
            ),
        )
    )
    for k in (0, 1, 2, 3):
        if k in refused:
            with pytest.raises(
                ConfigError,
                match=f"{k} draft tokens: this engine's parallel drafter proposes all "
                "3 of its num_speculative_tokens in one forward, or none",
            ):
                engine.set_speculative_tokens(k)
        else:
            engine.set_speculative_tokens(k)
            assert scheduler.dynamic_sd_lookup == [0, k, k]
    engine.__dict__.pop("llm")  # nothing to close


def test_a_batch_size_the_kv_cache_cannot_hold_is_refused_by_name():
    class Engine:
        def kv_capacity_tokens(self):
            return 1000

        def kv_block_tokens(self):
            return 16

    asked = tune.TuneConfig(draft=None, target="t", batch_sizes=(1, 16, 32))
    with pytest.raises(
        ConfigError,
        match=r"--batch-sizes 16,32: the engine's KV cache holds 1000 tokens here, "
        r"and 32 requests of up to 112 tokens need 3584",
    ):  # 100 in 16-token blocks
        tune._held_sizes(asked, [1, 16, 32], [Engine()], 100)
    default = tune.TuneConfig(draft=None, target="t")
    assert tune._held_sizes(default, [1, 2, 4, 8, 16], [Engine()], 100) == [
        1,
        2,
        4,
        8,
    ]  # said, not refused
    wished = tune.TuneConfig(
        draft=None, target="t", batch_sizes=(1, 4, 16), fit_sizes=True
    )  # spec demo's sizes
    assert tune._held_sizes(wished, [1, 4, 16], [Engine()], 100) == [1, 4]


@pytest.fixture(scope="module")
def trained(sized, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("tune") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(sized["root"] / "home"))
    try:
        assert (
            main(
                [
                    "train",
                    "--cache",
                    str(sized["cache"]),
                    "-v",
                    str(sized["vm"]),
                    "-o",
                    str(run),
                    "--max-steps",
                    "20",
                    "--lr",
                    "1e-2",
                    "--ttt-steps",
                    "2",
                    "-q",
                ]
            )
            == 0
        )
    finally:
        mp.undo()
    return {**sized, "run": run}


class _Meter:
    busy = False

    def stop(self, threads, cores, on_cpu=True):
        warning = (
            "the machine was too busy for these speeds to mean much: test" if self.busy else None
        )
        return {"too_busy": self.busy, "warning": warning, "threads": threads, "cores": cores}


def test_torch_sweeps_chains_and_trees_at_batch_1_and_recommends_the_fastest(
    trained, tmp_path, monkeypatch
):
    monkeypatch.setattr(tune.threads, "Meter", _Meter)
    out = tmp_path / "tune"
    assert (
        main(
            [
                "tune",
                str(trained["run"]),
                "-t",
                str(trained["target"]),
                "--engine",
                "torch",
                "--max-k",
                "2",
                "--requests",
                "2",
                "--max-new-tokens",
                "12",
                "--repeats",
                "1",
                "-o",
                str(out),
                "-q",
            ]
        )
        == 0
    )
    report = json.loads((out / "serving.json").read_text())
    rows = report["table"]
    assert [r["config"] for r in rows] == [
        "target",
        "chain 1",
        "chain 2",
        "tree 2x2/8",
        "tree 2x4/16",
    ]
    assert all(r["batch_size"] == 1 and r["same_as_target"] for r in rows)
    assert all(r["acceptance_length"] >= 1 for r in rows if r["config"] != "target")
    fastest = max(rows, key=lambda r: r["tokens_per_s"])  # the target alone too: no drafts at all
    assert [r["config"] for r in rows if r["fastest"]] == [fastest["config"]]
    decoding = report["decoding"]
    if fastest["config"] == "target":
        assert decoding is None and report["why"].startswith(
            "no configuration with drafts was faster"
        )
    else:
        assert (decoding["depth"], decoding["topk"], decoding["num_tokens"]) == (
            fastest["depth"],
            fastest["topk"],
            fastest["num_tokens"],
        )
        assert (
            report["serve"].startswith("spec eval")
            and f"--depth {fastest['depth']}" in report["serve"]
        )


def test_a_busy_machines_speeds_are_not_recommended(trained, tmp_path, monkeypatch, capsys):
    busy = type("Busy", (_Meter,), {"busy": True})
    monkeypatch.setattr(tune.threads, "Meter", busy)
    out = tmp_path / "tune"
    assert (
        main(
            [
                "tune",
                str(trained["run"]),
                "-t",
                str(trained["target"]),
                "--engine",
                "torch",
                "--max-k",
                "1",
                "--requests",
                "1",
                "--max-new-tokens",
                "4",
                "--repeats",
                "1",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "serving.json").read_text())
    assert report["decoding"] is None and report["why"].startswith(
        "refused: the machine was too busy"
    )
    assert report["table"]  # the measurements are kept, marked
    assert "no recommendation: the machine was too busy" in " ".join(
        capsys.readouterr().err.split()
    )


def test_the_work_is_said_before_the_first_engine_load_and_its_time_after_the_first_run(
    trained, tmp_path, monkeypatch, capsys
):
    """How long tune takes depends on the machine: the runs, prompts and loads before anything
    loads, then the time the rest takes at the first run's pace."""
    from spec_cli.eval import session

    monkeypatch.setattr(tune.threads, "Meter", _Meter)
    before_load = []
    real = session.TorchSession

    def loading(*args, **kwargs):
        before_load.append(" ".join(capsys.readouterr().out.split()))
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "TorchSession", loading)
    assert (
        main(
            [
                "tune",
                str(trained["run"]),
                "-t",
                str(trained["target"]),
                "--engine",
                "torch",
                "--max-k",
                "1",
                "--requests",
                "2",
                "--max-new-tokens",
                "4",
                "--repeats",
                "3",
                "-o",
                str(tmp_path / "tune"),
            ]
        )
        == 0
    )
    assert len(before_load) == 1
    assert (
        "tune: 6 runs (2 configurations: the target alone, chains 1-1; batch size 1; "
        "3 repeats), each decoding 2 prompts of up to 4 new tokens; the target and the draft "
        "load once in PyTorch. How long they take on this machine is said once the first run "
        "is timed"
    ) in before_load[0]
    after = " ".join(capsys.readouterr().out.split())
    assert re.search(
        r"tune: the first run decoded \d+ tokens in [\d.]+ s; at that pace the rest "
        r"takes about \S+",
        after,
    ), after


def test_the_forecast_scales_the_first_run_to_every_batch_size_and_load(monkeypatch, capsys):
    monkeypatch.setattr(tune, "BATCH_SPEED_POWER", 0.5)
    cfg = tune.TuneConfig(draft=None, target="t", requests=2, repeats=2)
    forecast = tune._Forecast(cfg, runs_per_size=2 * 3, verify=True)  # 3 configurations, 2 repeats
    forecast.loads_left, forecast.load_seconds = 2, 30.0
    forecast.first_run([1, 4], 1, tokens=100, seconds=10.0)
    forecast.first_run([1, 4], 1, tokens=100, seconds=99.0)  # said once
    # one request at 10 tokens/s, 50 tokens a prompt: a run at batch 1 takes 2 x 50 / 10 = 10 s, at
    # batch 4 (4 prompts, 2x as fast) 4 x 50 / 20 = 10 s: 6 x 20 - the 10 s done = 110 s; 2 loads of
    # 30 s; the check: 2 loads and each size decoded twice, 60 + 40 s. 270 s in all
    assert " ".join(capsys.readouterr().out.split()) == (
        "tune: the first run decoded 100 tokens in 10.0 s; at that pace the rest takes about 4m30s "
        "(batch size b decoding b^0.5 times as fast; 2 more engine loads of 30s each, as one took; "
        "2 more to check a recommendation)"
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--engine", "torch", "--batch-sizes", "4"],
            "--engine torch decodes one request at a time",
        ),
        (["--batch-sizes", "1,x"], "--batch-sizes '1,x' is not a list of whole numbers"),
        (["--max-k", "9", "--engine", "torch", "--prompts", "EMPTY"], "no user turns found in"),
        ([], "spec tune needs vLLM, which is not installed"),
    ],
)
def test_bad_tune_input_is_one_line(trained, tmp_path, capsys, monkeypatch, args, says):
    from spec_cli.engine import vllm

    monkeypatch.setattr(vllm, "available", lambda: False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(
        json.dumps({"conversations": [{"from": "gpt", "value": "only an answer"}]}) + "\n"
    )
    args = [str(empty) if a == "EMPTY" else a for a in args]
    out = tmp_path / "tune"
    assert (
        main(["tune", str(trained["run"]), "-t", str(trained["target"]), "-o", str(out), *args])
        == 1
    )
    err = " ".join(capsys.readouterr().err.split())
    assert says in err, err
    assert not out.exists()


def test_a_parallel_drafter_is_tuned_one_engine_alive_at_a_time(
    peagle_pipeline, tmp_path, monkeypatch, capsys
):
    """A P-EAGLE draft needs an engine per k (each takes the GPU share of an engine alone): they load in
    turn, k --max-k (with k 0) down to 1 then the target alone, each measuring only its own k, and each is
    closed before the next starts. vLLM's Engine is a fake here that counts the engines alive."""
    from spec_cli.engine import vllm

    started = []

    class Engine:
        alive = most = 0

        def __init__(
            self,
            target,
            draft=None,
            num_speculative_tokens=3,
            *args,
            speculative_options=None,
            **kwargs,
        ):
            Engine.alive += 1
            Engine.most = max(Engine.most, Engine.alive)
            self.k = num_speculative_tokens if draft is not None else None
            self.parallel = bool((speculative_options or {}).get("parallel_drafting"))
            self.asked, self.closed = set(), False
            started.append(self)

        def set_speculative_tokens(self, k):
            self.asked.add(k)

        def generate_batch(
            self, prompts, max_tokens, **kwargs
        ):  # k 2 decodes other tokens than the target
            return [[8 if self.k == 2 else 7] * n for n in max_tokens]

        def kv_capacity_tokens(self):
            return None

        def close(self):
            Engine.alive -= not self.closed
            self.closed = True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    monkeypatch.setattr(vllm, "Engine", Engine)
    monkeypatch.setattr(vllm, "require", lambda purpose="": None)
    monkeypatch.setattr(vllm, "cannot_run", lambda fmt: "")
    monkeypatch.setattr(tune.threads, "Meter", _Meter)
    monkeypatch.setenv("SPEC_HOME", str(peagle_pipeline["root"] / "home"))
    out = tmp_path / "tune"
    assert (
        main(
            [
                "tune",
                str(peagle_pipeline["root"] / "run"),
                "-t",
                str(peagle_pipeline["target"]),
                "--max-k",
                "3",
                "--batch-sizes",
                "1,2",
                "--requests",
                "2",
                "--max-new-tokens",
                "4",
                "--repeats",
                "2",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    printed = " ".join(capsys.readouterr().out.split())
    assert "a parallel drafter is tuned one engine per k, loaded in turn: 4 loads of" in printed
    assert "one alive at a time (k 3 and 0, k 2, k 1, the target alone, 2 more to verify" in printed
    assert Engine.most == 1 and Engine.alive == 0 and all(e.closed for e in started)
    measuring = started[
        :4
    ]  # then _verify's two (target alone, the recommended config) when it recommends one
    assert [(e.k, e.parallel) for e in measuring] == [
        (3, True),
        (2, True),
        (1, True),
        (None, False),
    ]
    assert [e.asked for e in measuring] == [
        {0, 3},
        {2},
        {1},
        set(),
    ]  # each engine drafts its own k or none
    report = json.loads((out / "serving.json").read_text())
    assert len(started) == 4 + 2 * (report["verified"] is not None)
    table = report["table"]
    assert sorted((r["batch_size"], r["config"]) for r in table) == [
        (b, c) for b in (1, 2) for c in ("k0", "k1", "k2", "k3", "target")
    ]
    # the target alone, measured last, is still every engine's reference
    assert all(
        len(r["tokens_per_s_runs"]) == 2 and r["same_as_target"] == (r["config"] != "k2")
        for r in table
    )
    assert report["settings"]["draft_engine"]["engine_per_k"] is True
