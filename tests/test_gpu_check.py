"""bench/gpu_check.py starts and finishes on CPU with its tiny shape: every stage passes through the CLI
and the report holds what a GPU run is read for (tokens/s, peak memory, the attention kernels)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_runs_its_tiny_shape_on_cpu(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    assert (
        gpu_check.main(["--lengths", "128,256", "--steps", "2", "--out", str(tmp_path / "work")])
        == 0
    )
    report = json.loads((tmp_path / "work" / "gpu_check.json").read_text())
    assert report["shape"] == "tiny" and report["device"] == "cpu"
    stages = {s["stage"]: s for s in report["stages"]}
    assert list(stages) == [
        "build target",
        "build-vocab-map",
        "precompute T=128",
        "train --cache T=128",
        "train --cache --prefetch 0 T=128",
        "train --target --pack T=128",
        "train --target T=256",
        "packed TTT attention T=128",
    ]
    assert all(s["ok"] for s in stages.values())
    assert (
        stages["precompute T=128"]["tokens_per_s"] > 0
        and stages["train --target T=256"]["train_tokens_per_s"] > 0
    )
    assert (
        stages["train --cache T=128"]["peak_memory_gb"] > 0
        and stages["train --cache T=128"]["train_peak_memory_gb"] > 0
    )
    assert report["attention_kernels_checked"]  # the draft's kernel choice is reported
    packed = stages["packed TTT attention T=128"]["variants"]["per document"]
    assert (
        packed["calls"] > 0 and packed["seconds"] > 0
    )  # the per-document loop's kernel calls, counted
    # spec plan's prediction for each train stage's step, beside the measured peak
    assert set(report["plan_prediction"]["step_peak"]) == {"128", "256"}
    assert (
        stages["train --cache T=128"]["plan_peak_gb"] > 0
        and stages["train --target T=256"]["plan_peak_gb"] > 0
    )
