"""`spec train --context-parallel N` under torchrun (gloo): each row split over N ranks trains the same
draft as one process on the same batches (the objective's equality, term by term, is
tests/draft/test_context.py's), with DDP and FSDP2 over the ranks, through a stopped and resumed run,
for EAGLE-3 and EAGLE-1/2, and as 2 x 2 (context x data parallel) in four processes against one process
taking two micro-batches per step."""

import json

import pytest
import torch

from spec_cli.cli import main
from spec_cli.stages import train as stage
from tests.launch import torchrun
from tests.stages.test_train import config, weights
from tests.test_distributed import (
    eagle3_args,
    eagle_args,
    live_args,
    stopped_then_resumed,
    trainer_state,
)

pytestmark = pytest.mark.slow
FP32 = (
    "--precision",
    "fp32",
)  # both sides in fp32: their difference is then fp32 rounding, not bf16's


def assert_same(a: dict, b: dict) -> None:
    """Weights after 3 AdamW steps at lr 3e-3, from gradients that differ by fp32 rounding (the attention
    is summed in other pieces): Adam divides each gradient by its running RMS, so where a gradient is
    tiny its rounding shows in full; 1e-5 is 0.3% of one step, far below what one wrong term would do."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def remote_args(setup, url, out) -> list[str]:
    """live_args's run with its supervision from a `spec serve-target` at `url` (--remote)."""
    args = [
        a
        for a in live_args(setup, out, "replica")
        if a not in ("--target-parallel", "replica", "--dtype", "fp32")
    ]
    args[args.index(str(setup["target"]))] = url
    args[args.index("--target")] = "--remote"
    return [*args, *FP32]


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory, train_setup, eagle_pipeline) -> dict:
    """Every two-process run of this module in one torchrun launch (tests/launch.py), the 2 x 2 run in
    one of four. A server in this process supervises `--remote` runs: one process's (before the launch)
    and a context-parallel group's (in it); "calls" holds the batch shapes it ran for each."""
    from spec_cli.serve.plane import PlaneHost
    from tests.serve.harness import load_backend, start_server

    root = tmp_path_factory.mktemp("context")
    out = {
        name: root / name
        for name in (
            "cp",
            "cp-fsdp",
            "cp-stopped",
            "eagle-cp",
            "cp2x2",
            "live-cp",
            "remote-one",
            "remote-cp",
        )
    }
    cp = ("--context-parallel", "2", *FP32)
    server = start_server(
        load_backend(train_setup["target"]),
        train_setup["target"],
        plane=PlaneHost("127.0.0.1", 0, timeout=60),
    )
    calls = []
    real = server.logic.backend.generate_batch
    server.logic.backend.generate_batch = lambda *a, **k: (
        calls.append(a[0].shape if a else k["input_ids"].shape) or real(*a, **k)
    )
    try:
        assert main(remote_args(train_setup, server.url, out["remote-one"])) == 0
        alone = list(calls)
        calls.clear()
        torchrun(
            [
                eagle3_args(train_setup, out["cp"], *cp),
                eagle3_args(train_setup, out["cp-stopped"], *cp, "--max-time", "0.001s"),
                eagle3_args(train_setup, out["cp-fsdp"], *cp, "--fsdp"),
                eagle_args(eagle_pipeline, out["eagle-cp"], *cp),
                eagle3_args(train_setup, out["cp-stopped"], *cp, "--resume"),
                [*live_args(train_setup, out["live-cp"], "replica"), *cp],
                [
                    *remote_args(train_setup, server.url, out["remote-cp"]),
                    "--context-parallel",
                    "2",
                ],
            ],
            root / "launch",
        )
    finally:
        server.stop(grace=5)
        server.logic.backend.close()
    torchrun([eagle3_args(train_setup, out["cp2x2"], *cp)], root / "launch-4", processes=4)
    return {**out, "calls": {"alone": alone, "group": list(calls)}}


@pytest.fixture(scope="module")
def singles(train_setup, eagle_pipeline, tmp_path_factory) -> dict:
    """One process: one micro-batch per step (= a context-parallel group's batch), and two (= two groups')."""
    root = tmp_path_factory.mktemp("single")
    for name, accum in (("one", 1), ("two", 2)):
        assert (
            stage.run(
                config(
                    train_setup,
                    root / name,
                    max_steps=3,
                    grad_accum=accum,
                    eval_every=0,
                    save_every=3,
                    log_every=2,
                    precision="fp32",
                )
            ).steps
            == 3
        )
    assert main(eagle_args(eagle_pipeline, root / "eagle", *FP32)) == 0
    live = [
        a
        for a in live_args(train_setup, root / "live", "replica")
        if a not in ("--target-parallel", "replica")
    ]
    assert main([*live, *FP32]) == 0
    return {
        "one": root / "one",
        "two": root / "two",
        "eagle": root / "eagle",
        "live": root / "live",
    }


def logged(run) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_context_parallel_trains_what_one_process_trains(cp_runs, singles):
    for name in ("cp", "cp-fsdp"):
        assert_same(weights(singles["one"]), weights(cp_runs[name]))
    assert (
        trainer_state(cp_runs["cp"])["parallel"] == "ddp"
        and trainer_state(cp_runs["cp-fsdp"])["parallel"] == "fsdp"
    )
    # the logged losses and per-step accuracies: each rank's share, added over the group
    one, cp = logged(singles["one"]), logged(cp_runs["cp"])
    train_one = [r for r in one if r["split"] == "train"]
    train_cp = [r for r in cp if r["split"] == "train"]
    assert [r["step"] for r in train_one] == [r["step"] for r in train_cp] == [2, 3]
    for a, b in zip(train_one, train_cp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["acc"] == pytest.approx(
            a["acc"], abs=1e-12
        )
        assert b["tokens"] == a["tokens"]
        # the gradient itself, not only its direction (which is all AdamW's weights can tell): each rank's
        # share of the loss is multiplied by N before DDP averages over the N ranks
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    evals = [[r for r in log if r["split"] == "eval"] for log in (one, cp)]
    assert evals[0][-1]["acc"] == pytest.approx(evals[1][-1]["acc"], abs=1e-12)
    assert evals[1][-1]["loss"] == pytest.approx(evals[0][-1]["loss"], rel=1e-5)


def test_context_parallel_resumes_as_the_straight_run(cp_runs):
    stopped_then_resumed(cp_runs["cp-stopped"])
    assert_same(weights(cp_runs["cp"]), weights(cp_runs["cp-stopped"]))


def test_eagle_under_context_parallelism(cp_runs, singles):
    assert_same(weights(singles["eagle"]), weights(cp_runs["eagle-cp"]))


def test_a_live_target_under_context_parallelism(cp_runs, singles):
    """A live target, run once per group on its first rank, which sends the other its slots (target/group.py)."""
    assert_same(weights(singles["live"]), weights(cp_runs["live-cp"]))


def test_two_by_two_context_and_data_parallel(cp_runs, singles):
    """4 processes: 2 context-parallel groups of 2, each its own batch == 1 process, 2 micro-batches a step."""
    assert_same(weights(singles["two"]), weights(cp_runs["cp2x2"]))
    assert trainer_state(cp_runs["cp2x2"])["world_size"] == 4


@pytest.mark.parametrize("pack", [False, True])
def test_a_cache_reads_only_a_ranks_slots(train_setup, pack):
    """Under --context-parallel a rank reads the ranges of its rows' slots it trains on (kept_ranges), not
    the whole rows: every field but the whole-row inputs equals the whole batch's at those slots (the
    last slot of each range, which the objective never reads, has no next slot to shift in)."""
    from spec_cli.artifacts.vocab_map import load_vocab_map
    from spec_cli.draft.context import kept_ranges, padded_length
    from spec_cli.trainer.sources import inputs_for, open_source

    cfg = config(train_setup, train_setup["root"] / "unused", pack=pack)
    source = open_source(cfg, torch.device("cpu"), load_vocab_map(train_setup["vm"]))
    source.backend.set_vocab_mapping(load_vocab_map(train_setup["vm"]).selected_token_ids)
    indices = source.plan[0]
    whole = source.backend.generate_batch(**inputs_for(source, indices, pack))
    T = padded_length(whole.attention_mask.shape[1], 2)
    for rank in (0, 1):
        ranges = kept_ranges(2, rank, T, 3)
        source.slots_for = lambda length: (T, ranges)
        part = source.backend.generate_batch(**inputs_for(source, indices, pack))
        rows = torch.cat(
            [torch.arange(a, b - 1) for a, b in ranges]
        )  # the kept slots but each range's last
        places = torch.cat(
            [
                torch.arange(
                    sum(y - x for x, y in ranges[:i]), sum(y - x for x, y in ranges[: i + 1]) - 1
                )
                for i in range(len(ranges))
            ]
        )
        assert part.slots.tolist() == [r for a, b in ranges for r in range(a, b)]
        assert part.attention_mask.shape[1] == T and part.aux_hidden.shape[1] == len(part.slots)
        padded = {
            name: torch.nn.functional.pad(
                getattr(whole, name),
                (0, 0) * (getattr(whole, name).dim() - 2) + (0, T - whole.attention_mask.shape[1]),
            )
            for name in (
                "aux_hidden",
                "target_p",
                "target_mass",
                "target_ids",
                "position_mask",
                "loss_mask",
                "input_ids",
            )
        }
        for name, value in padded.items():
            torch.testing.assert_close(
                getattr(part, name)[:, places], value[:, rows], msg=name, rtol=0, atol=0
            )
    source.backend.close()


def test_a_served_target_is_asked_once_per_group(cp_runs, singles):
    """--remote under --context-parallel 2: the group's first rank asks the server (over its tensor plane)
    and sends the other rank its slots: the server runs each batch once, as for one process, and the
    draft is the one the live target trains."""
    alone, group = cp_runs["calls"]["alone"], cp_runs["calls"]["group"]
    # each batch once, whole rows, as one process asks (the prefetched next batch may reach the server first)
    assert sorted(map(tuple, group)) == sorted(map(tuple, alone)) and len(alone) >= 2
    assert_same(weights(singles["live"]), weights(cp_runs["remote-cp"]))
    assert_same(weights(cp_runs["remote-one"]), weights(cp_runs["remote-cp"]))
