"""Pinned numbers of short `spec train` runs (torchtune-style recipe test), one per algorithm (EAGLE-3 on
rows and packed, EAGLE-1/2, P-EAGLE): a tiny peaked Llama target, a feature cache made for the
algorithm, fixed seed, CPU fp32, one thread. Every logged loss, per-step loss and accuracy of 8
optimizer steps is compared with values recorded from this code, so a refactor or an "equivalent"
kernel that moves any training number fails here, whichever path and algorithm it shifts.

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
from tests.draft.runs import vocab_and_cache

pytestmark = pytest.mark.usefixtures("one_thread")

RUNS = {  # name -> (algorithm, extra CLI options)
    "rows": ("eagle3", ["--fc-norm"]),
    "packed": ("eagle3", ["--fc-norm", "--pack", "--batch-tokens", "256"]),
    "eagle": ("eagle", ["--algorithm", "eagle"]),
    "peagle": ("peagle", ["--algorithm", "peagle"]),
}
DRAFT_VOCAB = {
    "eagle3": 96,
    "eagle": 400,
    "peagle": 96,
}  # EAGLE-1/2 drafts from the target's whole vocabulary

# name -> per logged step: (step, loss, step_loss[0..2], acc[0..2]) (P-EAGLE: per draft position)
PINNED = {
    "eagle": [
        (1, 1.0930949, 1.1435821, 1.0661098, 1.0479403, 0.0, 0.0116279, 0.0),
        (2, 1.017095, 1.0429542, 1.0131462, 0.9816262, 0.040404, 0.010101, 0.0),
        (3, 1.0099792, 1.0919137, 0.9525468, 0.9537472, 0.0508475, 0.0508475, 0.0),
        (4, 1.0083238, 1.1061151, 0.9420611, 0.9383532, 0.010989, 0.021978, 0.0),
        (5, 0.864008, 0.9345679, 0.8067552, 0.8253242, 0.0576923, 0.1346154, 0.1538462),
        (6, 0.9121346, 1.0068377, 0.8473845, 0.845099, 0.0724638, 0.1304348, 0.1884058),
        (7, 0.7788401, 0.8312981, 0.7373321, 0.7487593, 0.1230769, 0.2153846, 0.2153846),
        (8, 0.8577029, 0.9393097, 0.7968585, 0.8062476, 0.0526316, 0.0526316, 0.0526316),
    ],
    "packed": [
        (1, 4.4717636, 4.6670361, 4.3896313, 4.2693167, 0.0, 0.0, 0.0),
        (2, 4.1937151, 4.1868358, 4.1549587, 4.2529097, 0.0106383, 0.0212766, 0.0),
        (3, 4.2578168, 4.3290501, 4.301271, 4.0921974, 0.0227273, 0.0340909, 0.0340909),
        (4, 4.5327792, 4.5459404, 4.5130405, 4.5368876, 0.010989, 0.010989, 0.010989),
        (5, 3.8015194, 3.8941064, 3.8031199, 3.6548522, 0.0522388, 0.0522388, 0.0522388),
        (6, 3.4969552, 3.6951625, 3.3777192, 3.3363016, 0.0540541, 0.0810811, 0.0810811),
        (7, 3.7576694, 3.7980106, 3.7520764, 3.7016273, 0.0657895, 0.0657895, 0.0657895),
        (8, 3.6457655, 3.7917783, 3.5834906, 3.4954646, 0.04, 0.04, 0.04),
    ],
    "peagle": [  # COD draws by (row, anchor): the same under any split of the row (CHANGELOG)
        (1, 4.698143, 4.6620026, 4.6862645, 4.7822461, 0.0, 0.0, 0.0),
        (2, 3.6529679, 3.5171824, 3.6838386, 4.2176981, 0.0505051, 0.0, 0.0),
        (3, 3.9028254, 3.9582443, 4.4304762, 3.5697269, 0.0508475, 0.0243902, 0.1071429),
        (4, 4.472847, 4.5480185, 4.4655819, 4.3358235, 0.010989, 0.015873, 0.0227273),
        (5, 3.9262989, 3.9915466, 3.9367096, 3.8266234, 0.0384615, 0.0277778, 0.08),
        (6, 4.1460109, 4.1840839, 4.102644, 4.1583638, 0.0144928, 0.0212766, 0.030303),
        (7, 3.6156037, 3.6853006, 4.0403066, 2.8867073, 0.0461538, 0.0222222, 0.0689655),
        (8, 4.2332683, 4.0666666, 4.8057318, 4.1292953, 0.0526316, 0.0, 0.0555556),
    ],
    "rows": [
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
    for algorithm, size in DRAFT_VOCAB.items():  # a map per size (rebuilt the same), a cache each
        vocab_and_cache(
            root,
            target,
            data,
            size,
            "--algorithm",
            algorithm,
            "--batch-tokens",
            "256",
            vm=f"vm-{size}.safetensors",
            cache=f"cache-{algorithm}",
        )
    return root


def _train(root, out, algorithm, extra) -> list[tuple]:
    assert (
        main(
            [
                "train",
                "--cache",
                str(root / f"cache-{algorithm}"),
                "-v",
                str(root / f"vm-{DRAFT_VOCAB[algorithm]}.safetensors"),
                "-o",
                str(out),
                "--ttt-steps",
                "3",
                "--lr",
                "3e-3",
                "--max-steps",
                "8",
                "--log-every",
                "1",
                "--eval-every",
                "0",
                "--save-every",
                "100",
                "--eval-fraction",
                "0",
                "--seed",
                "0",
                "--device",
                "cpu",
                "--dtype",
                "fp32",
                "-q",
                *extra,
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [
        (r["step"], r["loss"], *r["step_loss"], *r["acc"])
        for r in records
        if r.get("split") == "train"
    ]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_training_numbers_are_pinned(recipe_cache, tmp_path, name):
    got = _train(recipe_cache, tmp_path / name, *RUNS[name])
    if os.environ.get("SPEC_PRINT_RECIPE"):
        print(
            f"\n    {name!r}: [\n"
            + "".join(f"        {tuple(round(x, 7) for x in row)!r},\n" for row in got)
            + "    ],"
        )
    assert name in PINNED, (
        f"no pinned values for {name}: run with SPEC_PRINT_RECIPE=1 -s and paste them"
    )
    want = PINNED[name]
    assert [row[0] for row in got] == [row[0] for row in want]
    for g, w in zip(got, want):
        assert g[1:] == pytest.approx(w[1:], **TOL), f"{name} step {g[0]}"
    assert torch.get_num_threads() == 1
