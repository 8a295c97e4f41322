"""spec demo: every stage runs on the built-in assets (here: tiny stand-ins), and a rerun reuses what is
finished, resumes what is not, and redoes what depends on a newer artifact."""

import json
import random

import pytest
from safetensors import safe_open

from spec_cli import assets
from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.cli import main
from spec_cli.stages import demo
from tests import tiny
from tests.conftest import write_jsonl

TINY = demo.Profile(
    "quick",
    samples=24,
    max_length=64,
    regen_max_new_tokens=12,
    draft_vocab_size=96,
    ttt_steps=2,
    batch_tokens=256,
    steps=6,
    lr=3e-3,
    eval_prompts=2,
    eval_max_new_tokens=6,
    heldout_prompts=2,
    expected_minutes=1,
    eval_depth=2,
    original_samples=5,
    eval_compare_depths=(1,),
    engine_every=3,
    engine_prompts=2,
    engine_tokens=6,
    tune_max_k=1,
    tune_requests=1,
    tune_tokens=4,
    tune_repeats=1,
)


@pytest.fixture
def builtins(tmp_path, tiny_llama_dir, monkeypatch, one_thread):
    """The built-in assets replaced by a tiny peaked target, tiny ShareGPT and a 2-category MT-bench."""
    rng = random.Random(5)
    found = {
        "smollm2": tiny.peaked_copy(tiny_llama_dir, tmp_path / "target"),
        "sharegpt": write_jsonl(
            tmp_path / "sharegpt.jsonl", [tiny.random_sharegpt(rng) for _ in range(40)]
        ),
        "mt-bench": write_jsonl(
            tmp_path / "mt_bench.jsonl",
            [
                {
                    "question_id": 81 + i,
                    "category": ["writing", "math"][i % 2],
                    "turns": [tiny.random_text(rng, 3, 8), tiny.random_text(rng, 3, 8)],
                }
                for i in range(4)
            ],
        ),
    }
    monkeypatch.setattr(assets, "ensure_all", lambda install=True: found)
    monkeypatch.setitem(demo.PROFILES, "quick", TINY)
    return found


def record(folder):
    return json.loads((folder / demo.DEMO_JSON).read_text())


def statuses(folder) -> dict:
    return {s["name"]: s["status"] for s in record(folder)["stages"]}


def test_demo_runs_every_stage_then_reuses_them(builtins, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--engine", "transformers", "--quick", "-o", str(out)]) == 0
    assert statuses(out) == {
        "assets": "ready",
        "regenerate": "ran",
        "training data": "ran",
        "build-vocab-map": "ran",
        "precompute": "ran",
        "train": "ran",
        "export": "ran",
        "eval": "ran",
        "eval-heldout": "ran",
        "tune": "ran",
    }
    # the draft trains on what the target itself answered: every record of the regenerated file
    regenerated = [
        json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()
    ]
    assert len(regenerated) == TINY.samples
    assert all(
        m["role"] in ("system", "user", "assistant") for r in regenerated for m in r["messages"]
    )
    # ... then the next ShareGPT conversations with their original answers, in source order
    trained = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert (
        trained[: TINY.samples] == regenerated
        and len(trained) == TINY.samples + TINY.original_samples
    )
    originals = trained[TINY.samples :]
    sharegpt = builtins["sharegpt"].read_text().splitlines()
    last = max(r["source_index"] for r in regenerated)
    assert [r["source_index"] for r in originals] == list(
        range(last + 1, last + 1 + TINY.original_samples)
    )
    for r in originals:  # the answers are the data set's own, word for word
        source = json.loads(sharegpt[r["source_index"]])["conversations"]
        assert [m["content"] for m in r["messages"]] == [m["value"] for m in source]
    manifest = json.loads((out / "cache" / "manifest.json").read_text())
    assert str(out / "train.jsonl") in json.dumps(manifest)
    # the draft vocabulary comes from what the target itself wrote (what it predicts when served)
    from spec_cli.artifacts.vocab_map import load_vocab_map

    assert load_vocab_map(out / "vocab-96.safetensors").metadata["data"] == str(
        out / "regenerated.jsonl"
    )
    assert manifest["num_samples"] > TINY.samples  # the originals were trained on too
    # the held-out prompts come after every conversation trained on, and are reported on their own
    heldout = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert len(heldout) == TINY.heldout_prompts
    assert min(r["source_index"] for r in heldout) > max(r["source_index"] for r in trained)
    held_report = json.loads((out / "eval-heldout" / "eval.json").read_text())
    assert held_report["settings"]["prompts"] == str(out / "heldout.jsonl")
    assert record(out)["heldout"]["acceptance_length"] == pytest.approx(
        held_report["overall"]["acceptance_length"]
    )
    # training kept the checkpoint the engine (here PyTorch: --engine transformers) measured best, and the
    # export is that one: what vLLM loads, its config naming the draft vocab and the checkpoint it came from
    curve = record(out)["engine_curve"]
    assert [c["step"] for c in curve] == [3, 6] and all(c["engine"] == "torch" for c in curve)
    best = json.loads((out / "run" / ckpt.BEST / ckpt.BEST_JSON).read_text())
    assert best["step"] == max(
        c["step"]
        for c in curve
        if c["acceptance_length"] == max(x["acceptance_length"] for x in curve)
    )
    config = json.loads((out / "export-vllm" / "config.json").read_text())
    latest = ckpt.latest_checkpoint(out / "run")
    assert (
        config["spec_cli"]["checkpoint"] == str(out / "run" / ckpt.BEST)
        and config["draft_vocab_size"] == 96
    )
    assert config["spec_cli"]["step"] == best["step"] == record(out)["exported_step"]
    assert record(out)["last_step"] == 6
    with safe_open(str(out / "export-vllm" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("d2t").shape == (96,)
    report = json.loads((out / "eval" / "eval.json").read_text())
    assert report["draft"]["kind"] == "export" and report["settings"]["depth"] == 2
    assert report["settings"]["num_prompts"] == 2 and set(report["categories"]) == {
        "writing",
        "math",
    }
    assert report["overall"]["same_as_target"] == report["overall"]["turns"] == 4  # greedy: exact
    assert record(out)["acceptance_length"] == pytest.approx(report["overall"]["acceptance_length"])
    # MT-bench also decodes the shorter chain against the same baseline; the fastest is recorded
    assert report["settings"]["compare_depths"] == [1] and list(report["depths"]) == ["1", "2"]
    assert held_report["settings"]["compare_depths"] == []
    fastest = report["depths"][str(report["fastest_depth"])]
    assert record(out)["fastest_chain"] == {
        "depth": report["fastest_depth"],
        "speedup": fastest["speedup"],
        "acceptance_length": fastest["acceptance_length"],
        "compared": [1],
    }
    printed = capsys.readouterr().out
    if report["fastest_depth"] != TINY.eval_depth:
        assert "fastest chain here" in printed
    assert "acceptance length" in printed and "speed-up" in printed
    # the time was estimated from this machine's speeds, measured before the first stage
    estimate = record(out)["estimate"]
    assert set(estimate["stages"]) == {
        "regenerate",
        "precompute",
        "train",
        "eval",
        "eval-heldout",
        "tune",
    }
    assert all(v > 0 for v in estimate["speeds"].values()) and estimate["minutes"] > 0
    from spec_cli.stages.demo.clock import ENGINE_SLOWDOWN, EVAL_LOAD_SECONDS, OVERHEAD

    engine_tokens = (
        2 * TINY.engine_prompts * 2 * TINY.engine_tokens * 2
    )  # 2 evaluations, 2 turns, 2 decoders
    assert estimate["stages"]["train"] == pytest.approx(  # the steps at the measured training speed
        TINY.steps * TINY.batch_tokens / estimate["speeds"]["train"] * OVERHEAD["train"]
        + engine_tokens / estimate["speeds"]["decode"] * ENGINE_SLOWDOWN,
        rel=0.01,
        abs=0.01,
    )
    passes = 3  # the target alone, the chain of 2 and the compared chain of 1
    assert estimate["stages"]["eval"] == pytest.approx(
        EVAL_LOAD_SECONDS
        + TINY.eval_prompts
        * 2
        * TINY.eval_max_new_tokens
        * passes
        / estimate["speeds"]["decode"]
        * OVERHEAD["eval"],
        rel=0.01,
        abs=0.01,
    )
    assert estimate["stages"]["eval-heldout"] == pytest.approx(
        EVAL_LOAD_SECONDS
        + TINY.heldout_prompts
        * 2
        * TINY.eval_max_new_tokens
        * 2
        / estimate["speeds"]["decode"]
        * OVERHEAD["eval"],
        rel=0.01,
        abs=0.01,
    )
    assert f"estimated {estimate['minutes']:g} min at the start" in " ".join(printed.split())
    # once regenerate ran, the total is stated again with its real minutes in place of its estimate
    stages = {s["name"]: s for s in record(out)["stages"]}
    ran = sum(stages[n]["seconds"] for n in ("assets", "regenerate")) / 60
    assert estimate["revised_minutes"] == pytest.approx(
        ran + estimate["minutes"] - estimate["stages"]["regenerate"] / 60, abs=0.06
    )
    assert f"{estimate['revised_minutes']:g} after regenerate" in " ".join(printed.split())
    # and once training has run a third of its 6 steps, at the pace it measured (TrainPace, below)
    assert estimate["train_paced_minutes"] >= 0 and estimate["paced_minutes"] > 0
    assert f"{estimate['paced_minutes']:g} at training's measured pace" in " ".join(printed.split())
    assert "regenerate took" in " ".join(printed.split())
    assert str(out / "export-vllm") in "".join(printed.split())  # a long path wraps at 80 columns
    assert "same run; per turn median" in " ".join(
        printed.split()
    )  # the speed-up's per-turn spread
    # the final table: the acceptance measured while training, the step exported, how to serve it
    tuned = json.loads((out / "tune" / "serving.json").read_text())
    assert tuned["engine"] == "torch" and tuned["draft"]["step"] == best["step"]
    assert {r["config"] for r in tuned["table"]} == {"target", "chain 1"}
    assert "acceptance in torch while training" in " ".join(printed.split())
    assert "how to serve it (spec tune) batch 1 in PyTorch" in " ".join(printed.split())
    assert f"checkpoint exported step {best['step']}" in " ".join(printed.split())

    stamp = (latest / "model.safetensors").stat().st_mtime_ns
    eval_stamp = (out / "eval" / "eval.json").stat().st_mtime_ns
    first = {s["name"]: s["produced"] for s in record(out)["stages"]}
    assert first["train"]["status"] == "ran" and first["train"]["seconds"] > 0
    assert main(["demo", "--engine", "transformers", "--quick", "-o", str(out)]) == 0
    assert statuses(out) == {
        "assets": "ready",
        "regenerate": "reused",
        "training data": "reused",
        "build-vocab-map": "reused",
        "precompute": "reused",
        "train": "reused",
        "export": "reused",
        "eval": "reused",
        "eval-heldout": "reused",
        "tune": "reused",
    }
    # the rerun keeps each stage's real time and result from the run that produced it
    again = {s["name"]: s["produced"] for s in record(out)["stages"]}
    assert {k: v for k, v in again.items() if k != "assets"} == {
        k: v for k, v in first.items() if k != "assets"
    }
    assert record(out)["estimate"] is None  # nothing left to run: nothing measured
    assert (
        main(["demo", "--engine", "transformers", "--quick", "-o", str(out)]) == 0
    )  # and so does a third run
    assert {s["name"]: s["produced"] for s in record(out)["stages"]}["train"] == first["train"]
    assert "it ran in" in " ".join(capsys.readouterr().out.split())
    assert (latest / "model.safetensors").stat().st_mtime_ns == stamp
    assert (out / "eval" / "eval.json").stat().st_mtime_ns == eval_stamp
    assert record(out)["fastest_chain"]["depth"] == report["fastest_depth"]  # reused with the eval


def test_an_unfinished_training_resumes_and_later_stages_follow_it(builtins, tmp_path, capsys):
    # a time budget that runs out after the first step: the demo stops training there, with a
    # checkpoint, says loudly that the draft is weaker, and still exports and evaluates what it has
    out = tmp_path / "demo"
    assert (
        main(
            ["demo", "--engine", "transformers", "--quick", "-o", str(out), "--max-time", "0.001s"]
        )
        == 0
    )
    printed = " ".join(capsys.readouterr().out.split())
    assert "WARNING training stopped by --max-time at step 1 of 6" in printed
    assert ckpt.latest_checkpoint(out / "run").name == "step-00000001"
    first_eval = json.loads((out / "eval" / "eval.json").read_text())["draft"]["step"]
    assert first_eval == 1

    assert (
        main(["demo", "--engine", "transformers", "--quick", "-o", str(out)]) == 0
    )  # no cap: the rerun finishes the schedule
    assert statuses(out)["train"] == "resumed" and statuses(out)["export"] == "ran"
    assert ckpt.latest_checkpoint(out / "run").name == "step-00000006"
    curve = record(out)["engine_curve"]  # the stopped run's last step, then the resumed run's
    assert [c["step"] for c in curve] == [1, 3, 6]
    best = json.loads((out / "run" / ckpt.BEST / ckpt.BEST_JSON).read_text())["step"]
    assert json.loads((out / "eval" / "eval.json").read_text())["draft"]["step"] == best
    assert "WARNING training stopped" not in " ".join(capsys.readouterr().out.split())


def test_the_final_table_gives_the_speed_ups_spread_and_a_busy_machine_warning(
    tmp_path, capsys, monkeypatch
):
    """From a finished eval.json (reused): the per-turn spread beside the speed-up, and the eval's busy
    warning as a WARNING row, so a headline figure from a crowded machine is not taken at face value."""
    from spec_cli.ui import print_demo_summary

    monkeypatch.setattr(
        demo.loading, "fast_bf16", lambda device: False
    )  # the eval below ran in fp32
    export_dir, eval_dir = tmp_path / "export-vllm", tmp_path / "eval"
    export_dir.mkdir()
    eval_dir.mkdir()
    (export_dir / "config.json").write_text(json.dumps({"spec_cli": {"step": 5}}))
    mt_bench = tmp_path / "mt_bench.jsonl"
    spread = {"turns": 4, "median": 0.3, "q1": 0.25, "q3": 0.4, "min": 0.2, "max": 0.9}
    (eval_dir / "eval.json").write_text(
        json.dumps(
            {
                "draft": {"step": 5},
                "settings": {
                    "depth": TINY.eval_depth,
                    "topk": 1,
                    "max_new_tokens": TINY.eval_max_new_tokens,
                    "num_prompts": TINY.eval_prompts,
                    "prompts": str(mt_bench),
                    "dtype": "float32",
                    "compare_depths": [1],
                },
                "overall": {"acceptance_length": 1.5, "speedup": 0.31, "speedup_spread": spread},
                "depths": {
                    "1": {"acceptance_length": 1.3, "speedup": 0.9},
                    "2": {"acceptance_length": 1.5, "speedup": 0.31},
                },
                "busy": {
                    "too_busy": True,
                    "warning": "the machine was too busy for these speeds to mean much: "
                    "this process got 40% of the 2 core(s) it used",
                },
            }
        )
    )
    result = demo.DemoResult(folder=tmp_path, profile=TINY)
    assert (
        demo._eval(demo.DemoConfig(), TINY, {"mt-bench": mt_bench}, export_dir, eval_dir, result)
        == "reused"
    )
    print_demo_summary(result)
    printed = " ".join(capsys.readouterr().out.split())
    assert (
        "0.31x over the target alone (same prompts, same run; per turn median 0.30x, middle half "
        "0.25-0.40x, range 0.20-0.90x over 4 turns)" in printed
    )
    assert (
        "fastest chain here 1: speed-up 0.90x, acceptance length 1.30 (same run; chains of 1 compared "
        "with 2" in printed
    )
    assert (
        "WARNING MT-bench eval: the machine was too busy for these speeds to mean much: this process "
        "got 40% of the 2 core(s) it used" in printed
    )


def test_a_new_duration_estimate_keeps_the_folder_but_other_settings_do_not(tmp_path):
    from dataclasses import asdict, replace

    folder = tmp_path / "demo"
    demo._claim_folder(folder, TINY)
    demo._claim_folder(
        folder, replace(TINY, expected_minutes=TINY.expected_minutes + 3)
    )  # same artifacts
    record = json.loads((folder / demo.DEMO_JSON).read_text())
    assert record["profile"] == json.loads(
        json.dumps(asdict(replace(TINY, expected_minutes=TINY.expected_minutes + 3)))
    )
    demo._claim_folder(
        folder, replace(TINY, eval_compare_depths=(1,))
    )  # the eval reruns on its own settings
    with pytest.raises(demo.ConfigError, match="holds a demo with other settings"):
        demo._claim_folder(folder, replace(TINY, steps=TINY.steps + 1))


def test_demo_refuses_a_folder_it_does_not_own(builtins, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["demo", "--engine", "transformers", "--quick", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert (
        f"-o {out} is a folder holding files spec_cli did not write, not a spec demo folder"
        in " ".join(err.split())
    )
    assert (out / "notes.txt").read_text() == "mine"


def test_help_says_the_demo_is_sized_to_its_minutes(capsys):
    assert main(["demo", "--engine", "transformers", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "in --minutes (default 30)" in text
    assert "as many as the minutes buy on this machine" in text
    assert (
        "sizes the answers and steps from them, and sizes the steps again once the answers" in text
    )
    assert "--minutes" in text.split("Options")[1] and "full-<M>min" in text


def test_regenerate_and_precompute_run_the_target_in_bf16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(demo.loading, "fast_bf16", lambda device: True)
    assert demo.data_dtype(demo.DemoConfig()) == "bf16"
    assert demo.data_dtype(demo.DemoConfig(dtype="fp32")) == "fp32"  # --dtype wins
    monkeypatch.setattr(demo.loading, "fast_bf16", lambda device: False)
    assert demo.data_dtype(demo.DemoConfig()) is None  # the stages' default (fp32 on a CPU)


def test_regenerate_runs_in_vllm_where_it_is_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a)
    )
    assert demo.regen_engine(demo.DemoConfig()) == "vllm"
    assert demo.regen_engine(demo.DemoConfig(engine="transformers")) == "transformers"  # asked for
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert demo.regen_engine(demo.DemoConfig()) == "transformers"


def test_an_unknown_engine_is_one_line_before_the_folder_is_claimed(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--engine", "tgi", "--quick", "-o", str(out)]) == 1
    assert (
        capsys.readouterr().err.strip()
        == "error: unknown --engine 'tgi'; use auto, transformers or vllm"
    )
    assert not out.exists()


def test_conversations_with_unicode_line_separators_stay_whole(tmp_path):
    """ShareGPT text holds U+2028 (written as it is, ensure_ascii=False): the training data and the
    held-out prompts are cut at newlines only (the default demo's held-out stage once failed on it)."""
    tricky = {
        "conversations": [
            {"from": "human", "value": "first\u2028second\u0085third"},
            {"from": "gpt", "value": "ok\u2029done"},
        ]
    }
    plain = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [plain, tricky, plain, plain]),
        encoding="utf-8",
    )
    regenerated = tmp_path / "regenerated.jsonl"
    regenerated.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "a\u2028b"},
                    {"role": "assistant", "content": "c"},
                ],
                "source_index": 0,
            },
            ensure_ascii=False,
        )
        + "\n",
        encoding="utf-8",
    )
    profile = demo.Profile(
        "t",
        samples=1,
        original_samples=1,
        max_length=8,
        regen_max_new_tokens=1,
        draft_vocab_size=8,
        ttt_steps=1,
        batch_tokens=8,
        steps=1,
        lr=1e-3,
        eval_prompts=1,
        eval_max_new_tokens=1,
        heldout_prompts=1,
        expected_minutes=1,
    )
    data = tmp_path / "train.jsonl"
    demo._training_data(profile, {"sharegpt": sharegpt}, regenerated, data)
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").split("\n") if line]
    assert [r["source_index"] for r in rows] == [0, 1]
    assert rows[1]["messages"][0]["content"] == "first\u2028second\u0085third"
    held = demo._heldout_prompts(profile, {"sharegpt": sharegpt}, data, tmp_path)
    assert [
        json.loads(line)["source_index"]
        for line in held.read_text(encoding="utf-8").split("\n")
        if line
    ] == [2]


def test_the_estimate_counts_the_chains_the_mt_bench_eval_compares():
    """Each compared chain decodes every MT-bench turn once more (the baseline is shared); auto's count is
    what the machine measured (demo_clock.chains_compared), a list's is its length."""
    from dataclasses import replace

    from spec_cli.stages.demo.clock import EVAL_LOAD_SECONDS, OVERHEAD, Speeds, stage_seconds

    speeds = Speeds(batched_decode=100.0, prefill=1000.0, decode=10.0, train=500.0)
    one_pass = TINY.eval_prompts * 2 * TINY.eval_max_new_tokens / 10.0 * OVERHEAD["eval"]
    auto = replace(TINY, eval_compare_depths="auto", eval_depth=3)
    load = EVAL_LOAD_SECONDS
    assert stage_seconds(auto, speeds)["eval"] == pytest.approx(load + 2 * one_pass)
    assert stage_seconds(auto, speeds, compared=2)["eval"] == pytest.approx(load + 4 * one_pass)
    assert stage_seconds(replace(TINY, eval_compare_depths=(1, 2), eval_depth=2), speeds)[
        "eval"
    ] == pytest.approx(load + 3 * one_pass)
    assert stage_seconds(auto, speeds, compared=2)["eval-heldout"] == pytest.approx(
        load + TINY.heldout_prompts * 2 * TINY.eval_max_new_tokens * 2 / 10.0 * OVERHEAD["eval"]
    )


def test_the_estimate_of_a_one_pass_profile_moves_the_cache_into_regenerate():
    """Where vLLM answers and keeps the cache, precompute costs nothing and regenerate pays for the
    cache's rows beside its answers: less than the prefill a second pass costs (half of it), more than
    the answers alone."""
    from dataclasses import replace

    from spec_cli.stages.demo.clock import OVERHEAD, TOKENS_PER_CONVERSATION, Speeds, stage_seconds

    speeds = Speeds(batched_decode=100.0, prefill=1000.0, decode=10.0, train=500.0)
    profile = replace(TINY, one_pass_samples=40)
    two = stage_seconds(profile, speeds, engine="vllm")
    one = stage_seconds(profile.for_engine("vllm"), speeds, engine="vllm")
    assert profile.for_engine("transformers") == profile and one["precompute"] == 0
    answers_alone = stage_seconds(
        replace(profile, samples=40, original_samples=0), speeds, engine="vllm"
    )
    rows = 40 * TOKENS_PER_CONVERSATION / speeds.prefill
    assert one["regenerate"] == pytest.approx(
        answers_alone["regenerate"] + OVERHEAD["one-pass cache"] * rows
    )
    assert (
        answers_alone["regenerate"]
        < one["regenerate"]
        < answers_alone["regenerate"] + answers_alone["precompute"]
    )
    assert two["precompute"] > 0


def test_training_states_the_demo_total_again_at_the_pace_it_measured(capsys):
    """After 50 steps (or a third of those left) the stage's time at the measured pace replaces its
    estimate: the stages done as they ran + training at that pace + what the estimate gave the rest."""
    from pathlib import Path

    from spec_cli.console import set_quiet

    set_quiet(False)
    result = demo.DemoResult(
        Path("f"),
        TINY,
        stages=[
            demo.StageRecord("assets", "ran", 6.0, Path("a"), {}),
            demo.StageRecord("regenerate", "ran", 54.0, Path("r"), {}),
            demo.StageRecord("precompute", "ran", 120.0, Path("p"), {}),
        ],
    )
    result.estimate = {
        "minutes": 20.0,
        "stages": {
            "regenerate": 60.0,
            "precompute": 150.0,
            "train": 600.0,
            "eval": 200.0,
            "eval-heldout": 100.0,
        },
    }
    now = [1000.0]
    pace = demo.TrainPace(result, total=1000, first=0, clock=lambda: now[0])
    for step in range(1, 50):
        now[0] += 1.5
        pace(step)
    assert "train_paced_minutes" not in result.estimate  # not before the 50th step
    now[0] += 1.5
    pace(50)  # 50 steps in 75 s: 1,000 in 1,500 s
    assert result.estimate["train_paced_minutes"] == 25.0
    later = 20.0 * 60 - (60.0 + 150.0 + 600.0)  # the evals and the fixed part, as estimated
    assert result.estimate["paced_minutes"] == round((180.0 + 1500.0 + later) / 60, 1)
    captured = capsys.readouterr()
    printed = " ".join((captured.out + captured.err).split())
    assert (
        "50 steps in 1.2 min, so the stage takes about 25.0 min at this pace (estimated 10.0)"
        in printed
    )
    resumed = demo.TrainPace(result, total=1000, first=960, clock=lambda: now[0])
    assert resumed.at == 973  # a third of the 40 steps left

    # the engine in the loop evaluates after steps 100, 200, .. 1000: the ten still to come at step 50
    # add 30 s each to the pace of the 50 steps that ran without them
    now[0] = 1000.0
    engine = demo.TrainPace(
        result,
        total=1000,
        first=0,
        clock=lambda: now[0],
        engine_at=range(100, 1001, 100),
        engine_each=30.0,
    )
    now[0] += 75.0
    engine(50)
    assert result.estimate["train_paced_minutes"] == (1500.0 + 10 * 30.0) / 60
    assert "30.0 min at this pace with the engine's 10 evaluation(s) to come" in " ".join(
        capsys.readouterr().out.split()
    )


def test_an_estimate_measured_on_a_busy_machine_says_so(tmp_path, capsys, monkeypatch):
    """The start-of-run estimate comes from speeds measured now: on a crowded machine they are low and the
    estimate long (625 minutes once, 30 when quiet), so the line says the machine was busy."""
    from spec_cli import threads
    from spec_cli.stages.demo import clock as demo_clock
    from spec_cli.ui import print_demo_summary

    class Busy:
        def stop(self, threads, cores, on_cpu=True):
            return {
                "too_busy": True,
                "warning": "the machine was too busy for these speeds to mean much: "
                "other processes kept 1.9 of 2 cores busy",
            }

    monkeypatch.setattr(threads, "Meter", Busy)
    monkeypatch.setattr(
        demo_clock, "measure", lambda *a, **k: demo_clock.Speeds(100.0, 1000.0, 10.0, 500.0)
    )
    monkeypatch.setattr(demo.loading, "resolve_target", lambda path: path)
    result = demo.DemoResult(folder=tmp_path, profile=TINY)
    demo._estimate(
        demo.DemoConfig(engine="transformers", device="cpu"),
        TINY,
        {"smollm2": tmp_path},
        {},
        result,
        start=0.0,
    )
    estimate = result.estimate
    printed = " ".join(capsys.readouterr().out.split())
    assert (
        "WARNING: the machine was too busy for these speeds to mean much: other processes kept 1.9 of 2 "
        "cores busy; this estimate assumes the machine stays that busy" in printed
    )
    assert estimate["busy"]["too_busy"] is True
    result = demo.DemoResult(folder=tmp_path, profile=TINY, estimate=estimate)
    print_demo_summary(result)
    assert "at the start, on a busy machine" in " ".join(capsys.readouterr().out.split())


def test_the_final_table_heads_with_vllms_speed_up_and_gives_both_engines_tokens_per_second(
    tmp_path, capsys
):
    from spec_cli.ui import print_demo_summary

    result = demo.DemoResult(folder=tmp_path, profile=TINY, acceptance_length=1.46, speedup=0.87)
    result.vllm = {
        "acceptance_length": 1.46,
        "speedup": 1.04,
        "spec_tokens_per_s": 23.9,
        "target_tokens_per_s": 23.1,
        "note": "",
    }
    result.torch_tps = {"spec_tokens_per_s": 20.9, "target_tokens_per_s": 23.9}
    print_demo_summary(result)
    printed = " ".join(capsys.readouterr().out.split())
    assert (
        "speed-up in vLLM 1.04x over vLLM's target alone (23.9 vs 23.1 tokens/s; acceptance length 1.46"
        in printed
    )
    assert "speed-up in PyTorch 0.87x over the target alone (20.9 vs 23.9 tokens/s;" in printed
    assert printed.index("speed-up in vLLM") < printed.index("speed-up in PyTorch")
    result = demo.DemoResult(
        folder=tmp_path, profile=TINY, missing="vLLM is not installed, so regenerate runs"
    )
    print_demo_summary(result)
    assert "without vLLM vLLM is not installed, so regenerate runs" in " ".join(
        capsys.readouterr().out.split()
    )


# ----------------------------------------------------------------------------- spec demo --minutes

AVX2_LIKE = dict(batched_decode=200.0, prefill=1200.0, decode=25.0, train=1300.0)


def test_the_minutes_are_split_into_the_most_answers_that_fit_and_four_passes_of_steps():
    """clock.size: the largest number of answers whose demo (PASSES passes of steps over them, the fixed
    stages, the engine in the loop) fits the seconds; more minutes buy more of both."""
    from spec_cli.stages.demo import clock

    speeds = clock.Speeds(**AVX2_LIKE)
    full = demo.DemoConfig().profile.for_engine("vllm")
    assert full.minutes == demo.DEFAULT_MINUTES and not full.sized

    def seconds(p):
        return clock.demo_seconds(p, speeds, "vllm", 0, "vllm")

    chosen = clock.size(full, speeds, 1800.0, "vllm", 0, "vllm")
    assert chosen.sized and chosen.original_samples == 0
    assert chosen.samples == chosen.one_pass_samples
    assert seconds(chosen) <= 1800.0 < seconds(clock.sized(full, chosen.samples + 1))
    tokens = chosen.samples * clock.TOKENS_PER_CONVERSATION
    assert chosen.steps * full.batch_tokens / tokens == pytest.approx(clock.PASSES, abs=0.1)
    assert chosen.engine_every % 50 == 0 and chosen.steps / chosen.engine_every == pytest.approx(
        clock.ENGINE_EVALUATIONS, rel=0.3
    )
    longer = clock.size(full, speeds, 3600.0, "vllm", 0, "vllm")
    assert (
        longer.samples > 2 * chosen.samples and longer.steps > 2 * chosen.steps
    )  # past the fixed part

    with pytest.raises(ValueError) as too_few:
        clock.size(full, speeds, 600.0, "vllm", 0, "vllm")
    smallest = clock.sized(full, clock.MIN_ANSWERS)
    assert too_few.value.args[0] == pytest.approx(seconds(smallest)) and seconds(smallest) > 600


def test_the_steps_are_sized_again_to_the_time_left_up_to_max_passes():
    from spec_cli.stages.demo import clock

    speeds = clock.Speeds(**AVX2_LIKE)
    chosen = clock.size(
        demo.DemoConfig().profile.for_engine("vllm"), speeds, 1800.0, "vllm", 0, "vllm"
    )
    after = ("train", "eval", "eval-vllm", "eval-heldout", "tune", "fixed")

    def rest(steps):
        parts = clock.stage_seconds(
            clock.sized(chosen, chosen.samples, steps), speeds, "vllm", 0, "vllm"
        )
        return sum(parts[n] for n in after)

    left = rest(chosen.steps) * 1.1  # the data stages ran faster than estimated
    steps = clock.steps_for(chosen, speeds, left, "vllm", 0)
    assert steps > chosen.steps and rest(steps) <= left < rest(steps + 1)
    assert clock.steps_for(chosen, speeds, rest(chosen.steps) * 0.8, "vllm", 0) < chosen.steps
    most = clock.passes_steps(chosen, chosen.samples, clock.MAX_PASSES)
    assert clock.steps_for(chosen, speeds, 10**7, "vllm", 0) == most  # a GPU: at most 8 passes
    assert clock.steps_for(chosen, speeds, 1.0, "vllm", 0) == clock.MIN_STEPS


def test_each_budget_has_its_own_default_folder():
    assert demo.DemoConfig().folder().name == "full"
    assert demo.DemoConfig(minutes=30).folder().name == "full"
    assert demo.DemoConfig(minutes=45).folder().name == "full-45min"
    assert demo.DemoConfig(quick=True).folder().name == "quick"


@pytest.fixture
def sized_builtins(builtins, monkeypatch):
    """The default profile as the tiny one, sized: a machine measured fast (every sizing reaches the
    answers' cap) unless a test says otherwise."""
    from dataclasses import replace

    from spec_cli.stages.demo import clock

    monkeypatch.setitem(demo.PROFILES, "full", replace(TINY, name="full"))
    monkeypatch.setattr(clock, "MIN_ANSWERS", 2)
    monkeypatch.setattr(clock, "MAX_ANSWERS", 6)
    monkeypatch.setattr(clock, "MIN_STEPS", 2)
    monkeypatch.setattr(clock, "FIXED_SECONDS", 0.0)
    speeds = {"now": clock.Speeds(10**6, 10**6, 10**6, 10**6)}
    monkeypatch.setattr(clock, "measure", lambda *a, **k: speeds["now"])
    return speeds


def test_the_default_demo_is_sized_to_its_minutes_and_a_rerun_continues_that_sizing(
    sized_builtins, tmp_path, capsys
):
    from spec_cli.stages.demo import clock

    out = tmp_path / "demo"
    assert main(["demo", "--engine", "transformers", "--minutes", "10", "-o", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    profile = record(out)["profile"]
    # the cap on answers (a fast machine), PASSES passes of steps at the start, then MAX_PASSES once the
    # data stages left time over: the steps sized again before training
    start_steps = clock.passes_steps(TINY, 6, clock.PASSES)
    steps = clock.passes_steps(TINY, 6, clock.MAX_PASSES)
    assert (profile["minutes"], profile["sized"], profile["samples"]) == (10, True, 6)
    assert profile["original_samples"] == 0 and profile["steps"] == steps > start_steps
    assert record(out)["estimate"]["sizing"]["answers"] == 6
    assert record(out)["estimate"]["resized_steps"] == {"from": start_steps, "to": steps}
    assert "sized to 10 minutes on this machine" in printed
    assert "--minutes 20 buys 6 answers" in printed  # the final table: what more minutes buy here
    assert f"training takes {steps} steps (sized {start_steps} at the start)" in printed
    regenerated = (out / "regenerated.jsonl").read_text().splitlines()
    assert len(regenerated) == 6 and (out / "train.jsonl").read_text().splitlines() == regenerated
    state = json.loads((ckpt.latest_checkpoint(out / "run") / "trainer_state.json").read_text())
    assert state["step"] == state["total_steps"] == steps

    # a rerun keeps the sizing (no new answers or steps on a machine now measured slower)
    sized_builtins["now"] = clock.Speeds(1.0, 1.0, 1.0, 1.0)
    assert main(["demo", "--engine", "transformers", "--minutes", "10", "-o", str(out)]) == 0
    assert set(statuses(out).values()) == {"ready", "reused"}
    assert record(out)["profile"] == profile
    # another budget in the same folder: refused, with how to continue it
    capsys.readouterr()
    assert main(["demo", "--engine", "transformers", "--minutes", "20", "-o", str(out)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "sized to 10 minutes" in err and "--minutes 10 continues it" in err


def test_too_few_minutes_say_the_least_this_machine_needs(sized_builtins, tmp_path, capsys):
    from spec_cli.stages.demo import clock

    sized_builtins["now"] = clock.Speeds(50.0, 50.0, 5.0, 50.0)
    out = tmp_path / "demo"
    assert main(["demo", "--engine", "transformers", "--minutes", "1", "-o", str(out)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "--minutes 1 is too few for the demo on this machine" in err
    need = int(err.split("use --minutes ")[1].split()[0])
    smallest = clock.demo_seconds(
        clock.sized(demo.PROFILES["full"], 2), sized_builtins["now"], "transformers", 0, "torch"
    )
    assert need == pytest.approx(smallest / 60, abs=1.5) and need > 1
    assert not (out / "regenerated.jsonl").exists()
    # the folder was claimed and never sized: another budget may take it (nothing was made for this one)
    again = demo.DemoConfig(engine="transformers", minutes=need + 5, output=out)
    assert demo._claim_folder(out, again.profile).minutes == need + 5
    assert record(out)["profile"]["minutes"] == need + 5


@pytest.mark.parametrize(
    "args,message",
    [
        (["--quick", "--minutes", "10"], "--minutes sizes the default demo"),
        (["--minutes", "0"], "--minutes 0 is not a length"),
        (["--minutes", "inf"], "--minutes inf is not a length"),
        (["--minutes", "nan"], "--minutes nan is not a length"),
    ],
)
def test_minutes_refused_with_quick_or_not_positive(tmp_path, capsys, args, message):
    assert main(["demo", *args, "-o", str(tmp_path / "d")]) == 1
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "d").exists()
