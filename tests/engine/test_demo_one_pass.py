"""`spec demo` where vLLM answers (the `vllm` extra): the data is the target's own answers only, and
regenerate keeps the feature cache as it answers (one pass of the target per answer), so the
build-vocab-map and precompute stages find their artifacts made, train reads that cache, and a rerun
reuses all three."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

pytest.importorskip("vllm")

from spec_cli import assets  # noqa: E402
from spec_cli.artifacts import feature_cache as fc  # noqa: E402
from spec_cli.artifacts.vocab_map import load_vocab_map  # noqa: E402
from spec_cli.cli import main  # noqa: E402
from spec_cli.stages import demo  # noqa: E402
from tests import tiny  # noqa: E402
from tests.conftest import write_jsonl  # noqa: E402
from tests.stages.test_demo import TINY, record, statuses  # noqa: E402
from tests.stages.test_regenerate import add_end_tokens  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # a vLLM engine per regenerate run (over 10 s)

LATER = (
    "_train",
    "_export",
    "_eval",
    "_eval_vllm",
    "_tune",
)  # not this test's: the same as without one pass


def test_the_demo_trains_on_the_cache_its_regenerate_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_HOME", str(tmp_path / "home"))
    rng = random.Random(3)
    found = {
        "smollm2": add_end_tokens(tiny.save_vllm_sized_target(tmp_path / "target")),
        "sharegpt": write_jsonl(
            tmp_path / "sharegpt.jsonl", [tiny.random_sharegpt(rng) for _ in range(40)]
        ),
        "mt-bench": write_jsonl(
            tmp_path / "mt.jsonl",
            [{"question_id": 81, "category": "writing", "turns": ["a b", "c d"]}],
        ),
    }
    profile = replace(
        TINY,
        samples=4,
        original_samples=5,
        one_pass_samples=12,
        max_length=128,
        regen_max_new_tokens=16,
    )
    monkeypatch.setattr(assets, "ensure_all", lambda install=True: found)
    monkeypatch.setitem(demo.PROFILES, "quick", profile)
    monkeypatch.setattr(demo, "_estimate", lambda cfg, profile, *a: profile)  # no probe
    for name in LATER:
        monkeypatch.setattr(demo, name, lambda *a, **k: "ran")
    out = tmp_path / "demo"
    args = ["demo", "--engine", "vllm", "--dtype", "fp32", "--quick", "-o", str(out), "-q"]

    assert main(args) == 0
    done = statuses(out)
    assert (done["regenerate"], done["build-vocab-map"], done["precompute"]) == (
        "ran",
        "in regenerate",
        "in regenerate",
    )
    carried = record(out)["profile"]
    assert carried["one_pass"] and (carried["samples"], carried["original_samples"]) == (12, 0)
    # the training data is the target's answers alone, and the cache and the vocab map are made from them
    regenerated = (out / "regenerated.jsonl").read_text()
    assert (out / "train.jsonl").read_text() == regenerated
    assert all(json.loads(line).get("source") != "sharegpt" for line in regenerated.splitlines())
    manifest = fc.read_manifest(out / "cache")
    assert manifest["num_samples"] == len(regenerated.splitlines()) == 12
    assert manifest["data"] == str(out / "regenerated.jsonl")
    vmap = load_vocab_map(out / f"vocab-{profile.draft_vocab_size}.safetensors")
    assert (
        vmap.metadata["data"] == str(out / "regenerated.jsonl")
        and manifest["vocab_map_fingerprint"] == vmap.fingerprint
    )
    sidecar = json.loads((out / "regenerated.jsonl.meta.json").read_text())
    assert (
        sidecar["features"]["rows_replayed"] == 12 and sidecar["features"]["from_generation"] > 0.15
    )

    # `spec train` reads that cache as the demo's train stage does
    assert (
        main(
            [
                "train",
                "--cache",
                str(out / "cache"),
                "--vocab-map",
                str(out / f"vocab-{profile.draft_vocab_size}.safetensors"),
                "-o",
                str(tmp_path / "run"),
                "--max-steps",
                "2",
                "--batch-tokens",
                "256",
                "--pack",
                "-q",
            ]
        )
        == 0
    )

    before = (out / "cache" / fc.MANIFEST).read_bytes()
    assert main(args) == 0  # a rerun: everything reused, the target not run again
    done = statuses(out)
    assert (done["regenerate"], done["build-vocab-map"], done["precompute"]) == ("reused",) * 3
    assert (out / "cache" / fc.MANIFEST).read_bytes() == before
