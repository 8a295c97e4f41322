"""Pinned numbers of a short `spec train` run (torchtune-style recipe test): a tiny peaked Llama
target, a feature cache, fixed seed, CPU fp32, one thread. Every logged loss, per-step loss and
accuracy of 8 optimizer steps is compared with values recorded from this code, so a refactor or an
"equivalent" kernel that moves any training number fails here, whichever path it shifts.

The values come from torch 2.13.0+cpu. If a deliberate change moves them (a new loss, a fixed bug),
rerun with SPEC_PRINT_RECIPE=1, check the new numbers are what the change should give, paste them
here and say why in CHANGELOG.md.
"""

import json
import os
import random

import pytest
import torch

from spec_cli.cli import main
from tests import tiny
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

RUNS = {  # name -> extra CLI options
    "rows": [],
    "packed": ["--pack", "--batch-tokens", "256"],
}

# name -> per logged step: (step, loss, step_loss[0..2], acc[0..2])
PINNED = {
    'packed': [
        (1, 4.4717636, 4.6670361, 4.3896313, 4.2693167, 0.0, 0.0, 0.0),
        (2, 4.1937151, 4.1868358, 4.1549587, 4.2529097, 0.0106383, 0.0212766, 0.0),
        (3, 4.2578168, 4.3290501, 4.301271, 4.0921974, 0.0227273, 0.0340909, 0.0340909),
        (4, 4.5327792, 4.5459404, 4.5130405, 4.5368876, 0.010989, 0.010989, 0.010989),
        (5, 3.8015194, 3.8941064, 3.8031199, 3.6548522, 0.0522388, 0.0522388, 0.0522388),
        (6, 3.4969552, 3.6951625, 3.3777192, 3.3363016, 0.0540541, 0.0810811, 0.0810811),
        (7, 3.7576694, 3.7980106, 3.7520764, 3.7016273, 0.0657895, 0.0657895, 0.0657895),
        (8, 3.6457655, 3.7917783, 3.5834906, 3.4954646, 0.04, 0.04, 0.04),
    ],
    'rows': [
        (1, 4.4058199, 4.351243, 4.3634233, 4.5440936, 0.0, 0.0, 0.0),
        (2, 4.1350632, 4.3985348, 4.0850163, 3.7859471, 0.0, 0.0, 0.010101),
        (3, 4.146533, 4.2735624, 4.1695452, 3.9192848, 0.0, 0.0169492, 0.0508475),
        (4, 4.5288506, 4.5398064, 4.5220609, 4.5202188, 0.010989, 0.010989, 0.010989),
        (5, 4.0131321, 4.0421171, 4.0584249, 3.9112279, 0.0384615, 0.0384615, 0.0384615),
        (6, 4.2339764, 4.2268348, 4.1430206, 4.35883, 0.0144928, 0.0144928, 0.0144928),
        (7, 3.7926691, 3.8599975, 3.8408275, 3.6272709, 0.0461538, 0.0461538, 0.0461538),
        (8, 4.0953717, 3.8890731, 4.2529078, 4.2207932, 0.0526316, 0.0526316, 0.0526316),
    ],
}

TOL = dict(rel=2e-4, abs=2e-5)


@pytest.fixture(scope="module")
def recipe_cache(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("recipe")
    target = tiny.peaked_copy(tiny_llama_dir, root / "peaky-llama")
    rng = random.Random(5)
    data = write_jsonl(root / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(32)])
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        assert main(["build-vocab-map", "-t", str(target), "-d", str(data), "--draft-vocab-size", "96",
                     "-o", str(root / "vm.safetensors"), "-q"]) == 0
        assert main(["precompute", "-t", str(target), "-d", str(data), "-v", str(root / "vm.safetensors"),
                     "-o", str(root / "cache"), "--batch-tokens", "256", "-q"]) == 0
    finally:
        mp.undo()
    return root


def _train(root, out, extra) -> list[tuple]:
    assert main(["train", "--cache", str(root / "cache"), "-v", str(root / "vm.safetensors"), "-o", str(out),
                 "--ttt-steps", "3", "--lr", "3e-3", "--max-steps", "8", "--log-every", "1",
                 "--eval-every", "0", "--save-every", "100", "--eval-fraction", "0", "--seed", "0",
                 "--fc-norm", "--device", "cpu", "--dtype", "fp32", "-q", *extra]) == 0
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], *r["step_loss"], *r["acc"]) for r in records if r.get("split") == "train"]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_training_numbers_are_pinned(recipe_cache, tmp_path, name):
    got = _train(recipe_cache, tmp_path / name, RUNS[name])
    if os.environ.get("SPEC_PRINT_RECIPE"):
        print(f"\n    {name!r}: [\n" + "".join(f"        {tuple(round(x, 7) for x in row)!r},\n" for row in got)
              + "    ],")
    assert name in PINNED, f"no pinned values for {name}: run with SPEC_PRINT_RECIPE=1 -s and paste them"
    want = PINNED[name]
    assert [row[0] for row in got] == [row[0] for row in want]
    for g, w in zip(got, want):
        assert g[1:] == pytest.approx(w[1:], **TOL), f"{name} step {g[0]}"
    assert torch.get_num_threads() == 1
