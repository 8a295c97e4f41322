"""torchrun x2 (gloo) for every stage and algorithm, in ONE launch (tests/launch.py: the two processes run
the commands in turn, each joining and leaving the process group itself): DDP and FSDP2 == one process
with the same global batch, also through a stop after the first step and a resume, for EAGLE-3, EAGLE-1/2
and P-EAGLE; precompute over two processes writes the one-process cache byte for byte."""

import json

import pytest
import torch
from safetensors.torch import load_file

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.cli import main
from spec_cli.stages import train as stage
from tests.draft.runs import log, peagle_train_args
from tests.launch import torchrun
from tests.stages.test_precompute import digest
from tests.stages.test_train import assert_same, config, weights

pytestmark = pytest.mark.slow


def strs(*args) -> list[str]:
    return [str(a) for a in args]


def eagle3_args(setup, out, *extra) -> list[str]:
    return strs(
        "train",
        "--cache",
        setup["cache"],
        "-v",
        setup["vm"],
        "-o",
        out,
        "--ttt-steps",
        "3",
        "--lr",
        "3e-3",
        "--max-steps",
        "3",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--eval-every",
        "0",
        "--log-every",
        "2",
        "--save-every",
        "3",
        "-q",
        *extra,
    )


def eagle_args(pipeline, out, *extra) -> list[str]:
    return strs(
        "train",
        "--cache",
        pipeline["root"] / "cache",
        "-v",
        pipeline["vm"],
        "--algorithm",
        "eagle",
        "--ttt-steps",
        "2",
        "--lr",
        "3e-3",
        "--max-steps",
        "3",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--eval-every",
        "0",
        "--save-every",
        "3",
        "-o",
        out,
        "-q",
        *extra,
    )


def peagle_args(pipeline, out, *extra) -> list[str]:
    return peagle_train_args(
        pipeline["root"],
        pipeline["vm"],
        out,
        "--eval-every",
        "0",
        "--max-steps",
        "3",
        "--save-every",
        "3",
        *extra,
    )


def dspark_args(pipeline, out, *extra) -> list[str]:
    """DSpark from the DFlash pipeline's cache (the same five aux layers), blocks of 3, 3 steps."""
    return strs(
        "train",
        "--cache",
        pipeline["root"] / "cache",
        "-v",
        pipeline["vm"],
        "--algorithm",
        "dspark",
        "--block-size",
        "3",
        "--markov-rank",
        "8",
        "--lr",
        "3e-3",
        "--max-steps",
        "3",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--eval-every",
        "0",
        "--save-every",
        "3",
        "-o",
        out,
        "-q",
        *extra,
    )


PEAGLE = {
    "ddp-1": ["--peagle-segments", "1"],
    "ddp-2": ["--peagle-segments", "2"],
    "fsdp-2": ["--peagle-segments", "2", "--fsdp"],
}


def live_args(setup, out, parallel) -> list[str]:
    """EAGLE-3 from the live tiny target, whole on each rank or sharded over both (--target-parallel)."""
    return strs(
        "train",
        "--target",
        setup["target"],
        "--data",
        setup["data"],
        "-v",
        setup["vm"],
        "-o",
        out,
        "--dtype",
        "fp32",
        "--target-parallel",
        parallel,
        "--ttt-steps",
        "2",
        "--lr",
        "3e-3",
        "--max-steps",
        "2",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--eval-every",
        "0",
        "-q",
    )


def precompute_args(setup, out) -> list[str]:
    return strs(
        "precompute",
        "-t",
        setup["target"],
        "-d",
        setup["data"],
        "-v",
        setup["vm"],
        "-o",
        out,
        "--batch-tokens",
        "512",
        "--shard-tokens",
        "600",
        "-q",
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, train_setup, eagle_pipeline, peagle_pipeline, dflash_pipeline) -> dict:
    """Every two-process command of this module, in one torchrun launch. A resume never directly follows
    its own stopped run, so nothing the processes still hold from that run can stand in for what the
    checkpoint must restore."""
    root = tmp_path_factory.mktemp("torchrun")
    out = {
        name: root / name
        for name in (
            "eagle3-ddp",
            "eagle3-fsdp",
            "eagle3-fsdp-straight",
            "eagle3-fsdp-accum",
            "eagle-fsdp",
            "eagle3-fsdp-muon",
            *(f"peagle-{k}" for k in PEAGLE),
            "precompute",
            "precompute-tensor",
            "live-replica",
            "live-tensor",
            "tp-supervision",
            "muon-shards",
            "eagle3-fsdp-sigterm",
            "dspark-ddp",
            "dspark-fsdp",
        )
    }
    torchrun(
        [
            # first, in fresh processes: it patches torch's Muon (float64 Newton-Schulz) and puts it
            # back; after the jobs below in the same two processes it once died of a heap corruption
            # (glibc abort) that it never showed alone
            ["-m", "tests.draft.muon_shards", out["muon-shards"]],
            eagle3_args(train_setup, out["eagle3-fsdp"], "--fsdp", "--max-time", "0.001s"),
            eagle_args(eagle_pipeline, out["eagle-fsdp"], "--fsdp", "--max-time", "0.001s"),
            eagle3_args(train_setup, out["eagle3-ddp"]),
            eagle3_args(
                train_setup,
                out["eagle3-fsdp-muon"],
                "--fsdp",
                "--optimizer",
                "muon",
                "--max-time",
                "0.001s",
            ),
            eagle3_args(train_setup, out["eagle3-fsdp-straight"], "--fsdp"),
            peagle_args(peagle_pipeline, out["peagle-ddp-1"], *PEAGLE["ddp-1"]),
            [
                "-m",
                "tests.stop_rank",
                1,
                1,
                *eagle3_args(train_setup, out["eagle3-fsdp-sigterm"], "--fsdp"),
            ],
            eagle3_args(train_setup, out["eagle3-fsdp"], "--fsdp", "--resume"),
            eagle3_args(train_setup, out["eagle3-fsdp-sigterm"], "--fsdp", "--resume"),
            eagle_args(eagle_pipeline, out["eagle-fsdp"], "--fsdp", "--resume"),
            eagle3_args(
                train_setup, out["eagle3-fsdp-muon"], "--fsdp", "--optimizer", "muon", "--resume"
            ),
            eagle3_args(
                train_setup,
                out["eagle3-fsdp-accum"],
                "--fsdp",
                "--grad-accum",
                "2",
                "--eval-every",
                "2",
            ),
            peagle_args(peagle_pipeline, out["peagle-ddp-2"], *PEAGLE["ddp-2"]),
            peagle_args(peagle_pipeline, out["peagle-fsdp-2"], *PEAGLE["fsdp-2"]),
            dspark_args(dflash_pipeline, out["dspark-ddp"]),
            dspark_args(dflash_pipeline, out["dspark-fsdp"], "--fsdp"),
            precompute_args(train_setup, out["precompute"]),
            [
                *precompute_args(train_setup, out["precompute-tensor"]),
                "--target-parallel",
                "tensor",
            ],
            live_args(train_setup, out["live-replica"], "replica"),
            live_args(train_setup, out["live-tensor"], "tensor"),
            ["-m", "tests.targets.tp_supervision", train_setup["target"], out["tp-supervision"]],
        ],
        root / "launch",
    )
    out["tp-supervision"].mkdir(exist_ok=True)
    return out


def trainer_state(run) -> dict:
    return json.loads((ckpt.latest_checkpoint(run) / "trainer_state.json").read_text())


def stopped_then_resumed(run) -> None:
    """The run stopped after its first step (--max-time: checkpoint 1) and its resume finished the schedule
    (checkpoint 3); --keep-last 3 keeps both."""
    assert [d.name for d in ckpt.checkpoint_dirs(run)] == ["step-00000001", "step-00000003"]
    first = json.loads((ckpt.checkpoint_dirs(run)[0] / "trainer_state.json").read_text())
    assert first["step"] == 1 and first["total_steps"] == 3


@pytest.fixture(scope="module")
def eagle3_single(train_setup, tmp_path_factory):
    """One process, two micro-batches per step: the global batch of two ranks of one."""
    out = tmp_path_factory.mktemp("eagle3-single") / "single"
    assert stage.run(config(train_setup, out, max_steps=3, grad_accum=2, eval_every=0)).steps == 3
    return out


def test_eagle3_ddp_two_processes_match_one_process(runs, eagle3_single):
    """2 gloo ranks x 1 micro-batch == 1 process x 2 micro-batches (same global batch)."""
    assert_same(weights(eagle3_single), weights(runs["eagle3-ddp"]), exact=False)
    assert trainer_state(runs["eagle3-ddp"])["parallel"] == "ddp"


def test_eagle3_fsdp_two_processes_match_one_process_through_a_resume(
    runs, eagle3_single, train_setup, tmp_path
):
    """FSDP2 over 2 gloo ranks == 1 process with the same global batch, also when the sharded run is
    stopped after its first step and resumed (the sharded checkpoint: test_fsdp_checkpoints_...)."""
    fsdp = runs["eagle3-fsdp"]
    stopped_then_resumed(fsdp)
    state = trainer_state(fsdp)
    assert state["parallel"] == "fsdp" and state["world_size"] == 2
    assert_same(weights(eagle3_single), weights(fsdp), exact=False)
    opt_single = load_file(str(ckpt.latest_checkpoint(eagle3_single) / "optimizer.safetensors"))
    opt_fsdp = ckpt.read_optimizer(ckpt.latest_checkpoint(fsdp))  # its ranks' shards put together
    assert_same(opt_single, opt_fsdp, exact=False)

    # gradient accumulation under FSDP: 2 ranks x 2 micro-batches == 1 process x 4
    stage.run(config(train_setup, tmp_path / "single4", max_steps=3, grad_accum=4, eval_every=0))
    assert_same(weights(tmp_path / "single4"), weights(runs["eagle3-fsdp-accum"]), exact=False)


def test_muon_orthogonalises_whole_matrices_under_fsdp(runs, train_setup, tmp_path):
    """--optimizer muon over FSDP2 shards: Newton-Schulz sees each matrix whole (DTensor's ops are global),
    so with float64 Newton-Schulz the sharded update equals the whole draft's exactly (tests/draft/
    muon_shards.py). Through the CLI (bf16 Newton-Schulz, which magnifies rounding in the reduced
    gradients), two ranks stopped after step 1 and resumed stay within a small part of one step of one
    process with the same global batch."""
    shards = json.loads((runs["muon-shards"] / "muon.json").read_text())
    assert all(d == 0.0 for d in shards["diff"].values()), shards["diff"]
    assert min(shards["moved"].values()) > 1e-3  # every parameter did move
    fsdp = runs["eagle3-fsdp-muon"]
    stopped_then_resumed(fsdp)
    single = tmp_path / "single-muon"
    assert (
        stage.run(
            config(train_setup, single, max_steps=3, grad_accum=2, eval_every=0, optimizer="muon")
        ).steps
        == 3
    )
    for key, value in weights(single).items():
        torch.testing.assert_close(
            weights(fsdp)[key], value, rtol=0, atol=2e-3, msg=key
        )  # a step: ~5e-3
    opt_single = load_file(str(ckpt.latest_checkpoint(single) / "optimizer.safetensors"))
    opt_fsdp = ckpt.read_optimizer(ckpt.latest_checkpoint(fsdp))
    assert opt_single.keys() == opt_fsdp.keys() and "state.fc.weight.momentum_buffer" in opt_fsdp


def test_fsdp_checkpoints_are_sharded_and_resume_bit_for_bit(runs):
    """Under FSDP2 each rank writes its own rows of the optimizer state (no gather; model.safetensors
    stays whole for export), and a run stopped after its first step and resumed from those shards, each
    rank reading only its own file and rows, ends bit for bit where the straight run ends."""
    for step in ckpt.checkpoint_dirs(runs["eagle3-fsdp"]):
        names = sorted(p.name for p in step.iterdir())
        assert "optimizer.safetensors" not in names
        assert [n for n in names if n.startswith("optimizer-")] == [
            "optimizer-00000-of-00002.safetensors",
            "optimizer-00001-of-00002.safetensors",
        ]
        assert json.loads((step / "trainer_state.json").read_text())["optimizer_shards"] == 2
        shards = [load_file(str(step / f"optimizer-0000{r}-of-00002.safetensors")) for r in (0, 1)]
        whole = ckpt.read_optimizer(step)
        for key, value in whole.items():  # rank 0 holds the first ceil(n / 2) rows, rank 1 the rest
            if value.dim():
                half = -(-value.shape[0] // 2)
                assert torch.equal(shards[0][key], value[:half]) and torch.equal(
                    shards[1][key], value[half:]
                )
    straight, resumed = (
        ckpt.latest_checkpoint(runs["eagle3-fsdp-straight"]),
        ckpt.latest_checkpoint(runs["eagle3-fsdp"]),
    )
    assert straight.name == resumed.name == "step-00000003"
    assert_same(weights(runs["eagle3-fsdp-straight"]), weights(runs["eagle3-fsdp"]), exact=True)
    assert_same(ckpt.read_optimizer(straight), ckpt.read_optimizer(resumed), exact=True)
    for r in (0, 1):
        name = f"optimizer-0000{r}-of-00002.safetensors"
        assert_same(load_file(str(straight / name)), load_file(str(resumed / name)), exact=True)


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step_and_the_resume_is_exact(runs):
    """SIGTERM reaches rank 1 alone, during step 1: both ranks agree at step 2's host sync, finish step 2,
    save it as one sharded checkpoint (--save-every 3 would not) and exit 143 (tests/stop_rank.py); the
    resume ends bit for bit where the straight run ends."""
    run, straight = runs["eagle3-fsdp-sigterm"], runs["eagle3-fsdp-straight"]
    assert [d.name for d in ckpt.checkpoint_dirs(run)] == ["step-00000002", "step-00000003"]
    stopped = ckpt.checkpoint_dirs(run)[0]
    assert json.loads((stopped / "trainer_state.json").read_text())["step"] == 2
    assert sorted(p.name for p in stopped.glob("optimizer-*")) == [
        "optimizer-00000-of-00002.safetensors",
        "optimizer-00001-of-00002.safetensors",
    ]
    assert_same(weights(straight), weights(run), exact=True)
    assert_same(
        ckpt.read_optimizer(ckpt.latest_checkpoint(straight)),
        ckpt.read_optimizer(ckpt.latest_checkpoint(run)),
        exact=True,
    )


def test_eagle_fsdp_two_processes_match_one_and_a_stopped_run_resumes_exactly(
    runs, eagle_pipeline, tmp_path, monkeypatch
):
    """EAGLE-1/2: torchrun x2 with FSDP2, stopped after its first step and resumed == one process with the
    same global batch; a single-process run stopped and resumed == its straight run, bit for bit. (DDP
    wraps the objective the same way for every algorithm: the EAGLE-3 tests above; measured for EAGLE-1/2
    too, bit-equal to --grad-accum 2, in the CHANGELOG.)"""
    monkeypatch.setenv("SPEC_HOME", str(eagle_pipeline["root"] / "home"))
    assert main(eagle_args(eagle_pipeline, tmp_path / "single", "--grad-accum", "2")) == 0
    assert (
        main(
            eagle_args(
                eagle_pipeline,
                tmp_path / "stopped",
                "--grad-accum",
                "2",
                "--max-time",
                "0.001s",
                "--save-every",
                "1",
            )
        )
        == 0
    )
    assert (
        main(eagle_args(eagle_pipeline, tmp_path / "stopped", "--grad-accum", "2", "--resume")) == 0
    )
    single = weights(tmp_path / "single")
    assert all(torch.equal(single[k], v) for k, v in weights(tmp_path / "stopped").items())
    fsdp = runs["eagle-fsdp"]
    stopped_then_resumed(fsdp)
    state = trainer_state(fsdp)
    assert state["parallel"] == "fsdp" and state["step"] == 3
    for key, value in weights(fsdp).items():
        torch.testing.assert_close(value, single[key], rtol=1e-5, atol=1e-6)


def test_peagle_ddp_and_fsdp_segments_match_one_forward_and_a_stopped_run_resumes_exactly(
    runs, peagle_pipeline, tmp_path, monkeypatch
):
    """A run stopped after its first step and resumed == the straight run, bit for bit (COD draws from
    the RNG the checkpoint restores); under torchrun x2, segments with a backward each (DDP, FSDP2) ==
    one forward per batch."""
    monkeypatch.setenv("SPEC_HOME", str(peagle_pipeline["root"] / "home"))
    args = (
        "--grad-accum",
        "2",
        "--peagle-segments",
        "2",
        "--eval-every",
        "0",
        "--max-steps",
        "3",
        "--save-every",
        "3",
    )
    root, vm = peagle_pipeline["root"], peagle_pipeline["vm"]
    assert main(peagle_train_args(root, vm, tmp_path / "single", *args)) == 0
    assert (
        main(
            peagle_train_args(
                root, vm, tmp_path / "stopped", *args, "--max-time", "0.001s", "--save-every", "1"
            )
        )
        == 0
    )
    assert main(peagle_train_args(root, vm, tmp_path / "stopped", *args, "--resume")) == 0
    single = weights(tmp_path / "single")
    assert all(torch.equal(single[k], v) for k, v in weights(tmp_path / "stopped").items())
    for name in PEAGLE:
        state = trainer_state(runs[f"peagle-{name}"])
        assert state["parallel"] == name.split("-")[0] and state["step"] == 3
    # Each rank draws its own COD samples (so two ranks are not one process); with the same ranks,
    # batches and draws, two segments per batch (a backward each, the gradients synced on the last)
    # train the weights one forward per batch does, under DDP and under FSDP2.
    # (Adam turns rounding-level gradient differences into weight differences of up to ~1e-4 x lr.)
    reference = weights(runs["peagle-ddp-1"])
    losses = [r["loss"] for r in log(runs["peagle-ddp-1"]) if r["split"] == "train"]
    for name in ("ddp-2", "fsdp-2"):
        run = runs[f"peagle-{name}"]
        assert [r["loss"] for r in log(run) if r["split"] == "train"] == pytest.approx(
            losses, rel=1e-5
        )
        for key, value in weights(run).items():
            torch.testing.assert_close(
                value, reference[key], rtol=1e-3, atol=1e-4, msg=f"{name}: {key}"
            )
    assert any(not torch.equal(v, single[k]) for k, v in reference.items())


def test_precompute_two_processes_write_the_same_cache(runs, train_setup, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_HOME", str(train_setup["root"] / "home"))
    single = tmp_path / "single"
    assert main(precompute_args(train_setup, single)) == 0
    assert (
        json.loads((single / "manifest.json").read_text())["num_shards"] > 1
    )  # work for both processes
    assert digest(runs["precompute"]) == digest(single)


def test_precompute_with_the_target_sharded_over_the_ranks(runs):
    """--target-parallel tensor: the two ranks run the target together for each other's shards (one
    rank has fewer batches and takes part in the other's last forwards with none of its own); the
    cache equals one process's within fp32 rounding, its ids, masks and argmaxes exactly."""
    single = runs["precompute"]  # two replicas: one process's cache byte for byte (the test above)
    manifest = json.loads((single / "manifest.json").read_text())
    shards = sorted(p.name for p in single.glob("shard-*.safetensors"))
    per_rank = [
        sum(e["batches"] for e in manifest["shards"] if e["shard"] % 2 == r) for r in (0, 1)
    ]
    assert per_rank[0] != per_rank[1]  # so one rank idles through the other's last forward(s)
    assert sorted(p.name for p in runs["precompute-tensor"].glob("shard-*.safetensors")) == shards
    for name in [
        *shards,
        "head.safetensors",
    ]:  # the head: the target's embedding and lm_head rows, whole
        a, b = load_file(str(single / name)), load_file(str(runs["precompute-tensor"] / name))
        assert a.keys() == b.keys()
        for key in a:
            if a[key].is_floating_point():
                torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)
            else:
                assert torch.equal(a[key], b[key]), key


def test_each_ranks_supervision_from_the_sharded_target_equals_the_whole_targets(runs):
    """--target-parallel tensor (tests/targets/tp_supervision.py, in the launch): batches of different
    shapes on each rank (one packed), exchanged and run together; each rank's supervision equals the
    whole target's within fp32 rounding."""
    ranks = [json.loads((runs["tp-supervision"] / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["shape"] for r in ranks] == [[2, 24, 96], [1, 31, 96]]  # each rank kept its own batch
    for r in ranks:
        assert r["sharded"] and not r["replica_sharded"] and r["keys"]
        assert max(r["diffs"].values()) <= 1e-5, r["diffs"]
        assert r["diffs"]["target_ids"] == 0 and r["diffs"]["position_mask"] == 0


def test_training_from_a_target_sharded_over_the_ranks_equals_training_from_whole_copies(runs):
    """--target-parallel tensor: the two ranks run the target together, each keeping its own batch's
    supervision (compared itself above)."""
    whole, sharded = weights(runs["live-replica"]), weights(runs["live-tensor"])
    assert_same(whole, sharded, exact=False)
    assert (
        json.loads((runs["live-tensor"] / "run.json").read_text())["options"]["target_parallel"]
        == "tensor"
    )


def test_dspark_ddp_and_fsdp_match_one_process(runs, dflash_pipeline, tmp_path, monkeypatch):
    """DSpark's heads (the Markov embedding's sparse rows, the fp32 confidence head) under DDP and FSDP2 ==
    one process with the same global batch."""
    monkeypatch.setenv("SPEC_HOME", str(dflash_pipeline["root"] / "home"))
    assert main(dspark_args(dflash_pipeline, tmp_path / "single", "--grad-accum", "2")) == 0
    single = weights(tmp_path / "single")
    for name in ("ddp", "fsdp"):
        run = runs[f"dspark-{name}"]
        assert trainer_state(run)["parallel"] == name and trainer_state(run)["world_size"] == 2
        assert_same(single, weights(run), exact=False)
