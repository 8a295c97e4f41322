"""vLLM in the training loop and `spec tune` (the `vllm` extra).

- `spec train --eval-engine vllm`: one engine for the whole run, each later checkpoint loaded into it by
  vLLM's in-place reload. The reloaded engine must measure what a fresh `spec eval --engine vllm` of the
  same checkpoint measures; the run's lm_head is negated after step 20, so a reload that silently kept
  the first weights would show.
- `spec tune`: the schedule it recommends is the fastest k measured at each batch size, and vLLM started
  with it decodes the target alone's greedy outputs."""

from __future__ import annotations

import json

import pytest

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.cli import main
from spec_cli.trainer import engine
from tests.stages.test_engine_eval import damage_after, sized  # noqa: F401 (sized: the module fixture)

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm_run(sized, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("vllm-loop") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(sized["root"] / "home"))
    damage_after(mp, 20)  # after step 20 the draft's head is negated: its proposals change entirely
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
                    "30",
                    "--lr",
                    "1e-2",
                    "--ttt-steps",
                    "2",
                    "--eval-fraction",
                    "0.15",
                    "--save-every",
                    "10",
                    "--keep-last",
                    "5",
                    "--eval-engine",
                    "vllm",
                    "--eval-engine-every",
                    "10",
                    "--eval-engine-wait",
                    "--eval-engine-prompts",
                    "4",
                    "--eval-engine-tokens",
                    "16",
                    "--keep",
                    "best",
                    "-q",
                ]
            )
            == 0
        )
    finally:
        mp.undo()
    records = [
        r
        for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
        if r["split"] == "engine"
    ]
    return {**sized, "run": run, "records": records}


@pytest.mark.slow
def test_the_reloaded_engine_measures_what_a_fresh_spec_eval_does(vllm_run, tmp_path):
    run, records = vllm_run["run"], vllm_run["records"]
    assert [r["step"] for r in records] == [10, 20, 30] and all(
        r["engine"] == "vllm" for r in records
    )
    by_step = {r["step"]: r for r in records}
    assert (
        by_step[20]["acceptance_length"] > by_step[30]["acceptance_length"] + 0.3
    )  # the negated head shows
    assert json.loads((run / ckpt.BEST / ckpt.BEST_JSON).read_text())["step"] == 20
    prompts = run / ckpt.ENGINE_EVAL / engine.PROMPTS
    for step in (30,):  # the third checkpoint the running engine took (two reloads)
        out = tmp_path / f"eval-{step}"
        assert (
            main(
                [
                    "eval",
                    "-t",
                    str(vllm_run["target"]),
                    "--draft",
                    str(run / ckpt.CHECKPOINTS / f"step-{step:08d}"),
                    "--prompts",
                    str(prompts),
                    "--max-new-tokens",
                    "16",
                    "--engine",
                    "vllm",
                    "-o",
                    str(out),
                    "-q",
                ]
            )
            == 0
        )
        fresh = json.loads((out / "eval.json").read_text())["overall"]
        in_loop = json.loads(
            (run / ckpt.ENGINE_EVAL / f"step-{step:08d}" / "eval.json").read_text()
        )["overall"]
        assert (fresh["accepted"], fresh["verified"]) == (
            in_loop["accepted"],
            in_loop["verified"],
        ), step
        assert fresh["acceptance_length"] == pytest.approx(by_step[step]["acceptance_length"])
        assert in_loop["same_as_target"] == in_loop["turns"]


class _QuietMeter:
    """threads.Meter as on a quiet machine (the suite runs two workers side by side: the real meter would
    rightly refuse to recommend from those speeds; refusing is tested in tests/stages/test_tune.py)."""

    def stop(self, threads, cores, on_cpu=True):
        return {
            "too_busy": False,
            "warning": None,
            "cpu_share": 1.0,
            "other_load": 0.0,
            "threads": threads,
            "cores": cores,
        }


@pytest.mark.slow
def test_tune_recommends_the_fastest_k_measured_and_vllm_serves_it_exactly(
    vllm_run, tmp_path, monkeypatch, capsys
):
    from spec_cli.stages import tune

    monkeypatch.setattr(tune.threads, "Meter", _QuietMeter)
    out = tmp_path / "tune"
    assert (
        main(
            [
                "tune",
                str(vllm_run["run"]),
                "-t",
                str(vllm_run["target"]),
                "--max-k",
                "2",
                "--batch-sizes",
                "1,2,4",
                "--requests",
                "2",
                "--max-new-tokens",
                "16",
                "--repeats",
                "2",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    printed = " ".join(capsys.readouterr().out.split())
    report = json.loads((out / "serving.json").read_text())
    table = report["table"]
    assert {(r["batch_size"], r["config"]) for r in table} == {
        (b, c) for b in (1, 2, 4) for c in ("target", "k0", "k1", "k2")
    }
    assert all(r["same_as_target"] and len(r["tokens_per_s_runs"]) == 2 for r in table)
    for b in (1, 2, 4):  # the recommended k at each size is the fastest median measured there
        rows = [r for r in table if r["batch_size"] == b and r["k"] is not None]
        fastest = max(rows, key=lambda r: (r["tokens_per_s"], -r["k"]))
        assert [r["k"] for r in rows if r["fastest"]] == [fastest["k"]]
    ks = tune.fastest_k(table)
    config = report["speculative_config"]
    if any(ks.values()):
        assert config["num_speculative_tokens_per_batch_size"] == tune.schedule_for(ks)
        assert config["method"] == "eagle3" and config["num_speculative_tokens"] == max(ks.values())
        assert (
            report["verified"]["all_same"] is True
        )  # a fresh vLLM with that config: the target's outputs
        assert "--speculative-config" in report["serve"] and "greedy outputs identical" in printed
    else:
        assert config is None and "no configuration with drafts was faster" in report["why"]
    assert (out / "speedup.png").stat().st_size > 0


@pytest.mark.slow
def test_tune_refuses_a_batch_size_the_kv_cache_cannot_hold_in_one_line(vllm_run, tmp_path, capsys):
    out = tmp_path / "tune"
    assert (
        main(
            [
                "tune",
                str(vllm_run["run"]),
                "-t",
                str(vllm_run["target"]),
                "--max-k",
                "1",
                "--batch-sizes",
                "1,100000",
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
        == 1
    )
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "--batch-sizes 100000: vLLM's KV cache here (VLLM_CPU_KVCACHE_SPACE=2 GiB) holds at most"
        in err
    ), err
    assert err.count("error:") == 1 and not out.exists()
