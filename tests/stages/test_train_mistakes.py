"""spec train and bad input (issue 27): a locked run folder, option ranges, a non-finite loss, EAGLE-3's
default aux layers on a shallow target, --resume of a moved run from its own run.json, and --resume -o RUN
with nothing else (the vocab map and the source from run.json too)."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_cli.artifacts import checkpoint as ckpt
from spec_cli.artifacts.guard import LOCK
from spec_cli.cli import main
from tests import tiny
from tests.conftest import write_jsonl
from tests.draft.runs import vocab_and_cache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    """Chat data, a vocab map and a feature cache of several shards (one small cache for the module)."""
    root = tmp_path_factory.mktemp("mistakes")
    data = write_jsonl(
        root / "chat.jsonl", [tiny.random_sharegpt(random.Random(i)) for i in range(24)]
    )
    vocab_and_cache(
        root, tiny_llama_dir, data, 96, "--batch-tokens", "512", "--shard-tokens", "600"
    )
    return {
        "root": root,
        "data": data,
        "vm": root / "vm.safetensors",
        "cache": root / "cache",
        "target": tiny_llama_dir,
    }


def train_args(setup, out, *extra, cache=None):
    return [
        "train",
        "-v",
        str(setup["vm"]),
        "--cache",
        str(cache or setup["cache"]),
        "-o",
        str(out),
        "--ttt-steps",
        "2",
        "--batch-tokens",
        "512",
        "--eval-fraction",
        "0.2",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "-q",
        *extra,
    ]


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` but the lock, with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK
    }


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


# ----------------------------------------------------------------------------- 1. the run folder's lock


def test_a_second_train_into_a_locked_run_folder_exits_1_naming_the_first(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(setup, run, "--max-steps", "1", "--lr", "3e-3")) == 0
    assert (run / LOCK).is_file()  # left behind, harmless: the kernel held the lock, not the file
    before = files(run)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from spec_cli.artifacts.guard import FolderLock\n"
            f"with FolderLock({str(run)!r}, 'spec train'):\n print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        assert (
            main(
                train_args(
                    setup, run, "--max-steps", "2", "--reschedule", "--lr", "3e-3", "--resume"
                )
            )
            == 1
        )
        assert error_line(capsys) == (
            f"error: {run} is in use by `spec train` (pid {holder.pid}); wait for it "
            "to finish or stop it, or write to another folder"
        )
    finally:
        holder.communicate("")
    assert files(run) == before  # nothing of the first run touched
    # once the other process is gone, the lock file in the folder disturbs nothing that lists it
    assert (
        main(train_args(setup, run, "--max-steps", "2", "--reschedule", "--lr", "3e-3", "--resume"))
        == 0
    )
    assert ckpt.latest_checkpoint(run).name == "step-00000002"
    capsys.readouterr()
    assert main(["inspect", str(run)]) == 0


# ----------------------------------------------------------------------------- 2. option ranges


@pytest.mark.parametrize(
    "option, value, allowed",
    [
        ("--lr", "0", "> 0"),
        ("--lr", "-1e-4", "> 0"),
        ("--lr", "nan", "> 0"),
        ("--lr", "inf", "> 0"),
        ("--step-weight", "0", "> 0"),
        ("--step-weight", "inf", "> 0"),
        ("--eval-fraction", "1", "in [0, 1)"),
        ("--eval-fraction", "-0.1", "in [0, 1)"),
        ("--warmup-ratio", "1.5", "in [0, 1]"),
        ("--min-lr-ratio", "nan", "in [0, 1]"),
        ("--cod-ratio", "1.1", "in [0, 1]"),
        ("--weight-decay", "-1", ">= 0"),
        ("--grad-clip", "-0.5", ">= 0"),
        ("--epochs", "0", "> 0"),
        ("--feature-weight", "-1", ">= 0"),
        ("--lk-kl-scale", "inf", ">= 0"),
        ("--draft-rope-theta", "inf", ">= 1"),
        ("--hidden-noise", "-0.05", ">= 0"),
        ("--muon-lr", "0", "> 0"),
        ("--muon-weight-decay", "-1", ">= 0"),
        ("--decay-ratio", "0", "in (0, 1]"),
    ],
)
def test_an_option_out_of_range_is_refused_by_name(setup, tmp_path, capsys, option, value, allowed):
    run = tmp_path / "run"
    assert main(train_args(setup, run, option, value)) == 1
    shown = f"{float(value):g}"
    assert (
        error_line(capsys)
        == f"error: {option} {shown} is out of range; {option} must be a finite number {allowed}"
    )
    assert not run.exists()  # refused before anything is written


def test_an_unknown_target_parallel_is_one_line_before_anything_is_written(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(setup, run, "--target-parallel", "pipeline")) == 1
    assert error_line(capsys) == (
        "error: unknown --target-parallel 'pipeline'; use one of auto, replica, tensor"
    )
    assert not run.exists()


def test_a_duration_or_size_of_inf_is_refused(setup, tmp_path, capsys):
    assert main(train_args(setup, tmp_path / "run", "--max-time", "inf")) == 1
    assert error_line(capsys).startswith("error: --max-time 'inf' is not a duration")
    assert main(train_args(setup, tmp_path / "run", "--stream-max-bytes", "infG")) == 1
    assert error_line(capsys) == (
        "error: --stream-max-bytes 'infG' is not a size; write auto, or a size such as "
        "512M, 4G or a number of bytes"
    )


def test_help_shows_the_ranges(capsys):
    assert main(["train", "--help"]) == 0
    out = re.sub(r"[\s│]+", " ", capsys.readouterr().out)
    assert (
        "Peak learning rate (AdamW, betas 0.9/0.95). Default: 1e-3 for EAGLE-3, 2e-4 for the other "
        "algorithms. Allowed: > 0." in out
    )
    assert "[default: 0.001]" not in out  # (the algorithm's default, said in the help)
    assert "Share of batches held out for evaluation. Allowed: in [0, 1)." in out


# ----------------------------------------------------------------------------- 3. a non-finite loss


def test_a_nan_in_the_cache_stops_training_naming_the_step_and_shard(setup, tmp_path, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(setup["cache"], cache)
    shards = sorted(cache.glob("shard-*.safetensors"))
    assert len(shards) >= 3
    bad = shards[1]
    tensors = load_file(str(bad))
    tensors["aux_hidden"] = torch.full_like(tensors["aux_hidden"], float("nan"))
    from safetensors import safe_open

    with safe_open(str(bad), "pt") as f:
        meta = f.metadata()
    save_file(tensors, str(bad), metadata=meta)
    run = tmp_path / "run"
    code = main(
        train_args(
            setup, run, "--lr", "3e-3", "--save-every", "1", "--max-steps", "40", cache=cache
        )
    )
    assert code == 1
    line = error_line(capsys)
    m = re.fullmatch(
        rf"error: step (\d+): the loss is nan on a batch from {re.escape(str(bad))}; the last good "
        rf"checkpoint (\S+) is kept; check it with `spec inspect {re.escape(str(cache))} --verify` "
        rf"and rebuild the cache with `spec precompute \.\.\. -o {re.escape(str(cache))} --no-resume`, "
        r"then rerun \(--resume continues from the checkpoint\)",
        line,
    )
    assert m, line
    step = int(m.group(1))
    latest = ckpt.latest_checkpoint(run)
    assert (
        str(latest) == m.group(2) and latest.name == f"step-{step - 1:08d}"
    )  # the bad state is not saved
    assert all(
        torch.isfinite(t).all() for t in load_file(str(latest / "model.safetensors")).values()
    )
    assert [
        r["step"]
        for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
        if r.get("split") == "train"
    ][-1] == step - 1


# ----------------------------------------------------------------------------- 4. aux layers on 6 layers


def test_eagle3_default_aux_layers_on_a_six_layer_target_train_silently(setup, tmp_path, capsys):
    six = tmp_path / "six"
    shutil.copytree(setup["target"], six)
    config = json.loads((six / "config.json").read_text())
    config["num_hidden_layers"] = 6
    (six / "config.json").write_text(json.dumps(config))
    common = [
        "train",
        "-t",
        str(six),
        "-d",
        str(setup["data"]),
        "-v",
        str(setup["vm"]),
        "--max-steps",
        "1",
        "--ttt-steps",
        "2",
        "--batch-tokens",
        "512",
        "--max-samples",
        "4",
        "--eval-fraction",
        "0",
        "-q",
    ]
    capsys.readouterr()
    assert main([*common, "-o", str(tmp_path / "run")]) == 0
    assert "repeats" not in capsys.readouterr().err
    # the rule [1, N//2-1, N-4] repeats layer 2 here; vLLM captures each layer once, so the default spreads
    assert json.loads((tmp_path / "run" / "run.json").read_text())["identity"]["aux_layers"] == [
        1,
        2,
        4,
    ]
    assert main([*common, "-o", str(tmp_path / "typed"), "--aux-layers", "1,3,3"]) == 0
    err = capsys.readouterr().err
    assert "warning: --aux-layers [1, 3, 3] repeats a layer" in err
    assert json.loads((tmp_path / "typed" / "run.json").read_text())["identity"]["aux_layers"] == [
        1,
        3,
        3,
    ]


def test_a_batch_tokens_the_cache_does_not_apply_is_said_and_pack_applies_it(
    setup, tmp_path, capsys
):
    """The cache was planned at 512 tokens a batch: --batch-tokens 256 beside it changes nothing (the
    step reads the cache's batch, as at 512), and the warning says so and how to apply it; with --pack
    the rows are planned at 256 and nothing is said. The cache's value, or none typed, says nothing."""

    def run(name: str, *extra: str, batch: str | None = "256") -> int:
        args = train_args(setup, tmp_path / name, "--max-steps", "1", *extra)
        if batch is None:
            args = [a for a in args if a not in ("--batch-tokens", "512")]
        else:
            args[args.index("512")] = batch
        assert main(args) == 0
        return json.loads((tmp_path / name / "log.jsonl").read_text().splitlines()[0])["tokens"]

    capsys.readouterr()
    other = run("other")
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"warning: --batch-tokens 256 does not apply: the feature cache {setup['cache']} keeps the "
        "batches `spec precompute` planned (512 tokens each, padding included); precompute with "
        "--batch-tokens 256, or add --pack to plan rows of 256 tokens from the cache"
    ) in err
    assert other == run("same", batch="512") == run("untyped", batch=None)
    assert run("packed", "--pack") <= 256
    assert "--batch-tokens" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- 5. --resume of a moved run


def test_a_moved_run_resumes_with_its_own_options(setup, tmp_path, capsys):
    options = [
        "--lr",
        "3e-3",
        "--warmup-ratio",
        "0.25",
        "--step-weight",
        "0.6",
        "--seed",
        "3",
        "--save-every",
        "2",
    ]
    straight = tmp_path / "straight"
    assert main(train_args(setup, straight, *options, "--max-steps", "4")) == 0
    first = tmp_path / "first"
    assert main(train_args(setup, first, *options, "--max-steps", "2")) == 0
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(str(first), str(moved))
    # only what differs is typed again: the rest (lr, warmup, step weight, seed, TTT steps...) is the run's
    assert (
        main(
            [
                "train",
                "--resume",
                "-o",
                str(moved),
                "-v",
                str(setup["vm"]),
                "--max-steps",
                "4",
                "--reschedule",
                "-q",
            ]
        )
        == 0
    )
    a, b = (
        load_file(str(ckpt.latest_checkpoint(r) / "model.safetensors")) for r in (straight, moved)
    )
    assert ckpt.latest_checkpoint(moved).name == "step-00000004" and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same run as one without a stop
    recorded = json.loads((moved / "run.json").read_text())["options"]
    assert (recorded["lr"], recorded["ttt_steps"], recorded["output"]) == (3e-3, 2, str(moved))


def test_resume_refuses_a_different_option_by_name_and_keeps_the_run(setup, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(setup, run, "--lr", "3e-3", "--max-steps", "1")) == 0
    before = files(run)
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                "--resume",
                "-o",
                str(run),
                "-v",
                str(setup["vm"]),
                "--lr",
                "1e-3",
                "--max-steps",
                "2",
                "--reschedule",
                "-q",
            ]
        )
        == 1
    )
    assert error_line(capsys) == (
        "error: --resume with a different lr: the run used 0.003, now 0.001; resume "
        "with the run's options, or start a new run folder"
    )
    assert files(run) == before
    # the same value typed again is fine
    assert (
        main(
            [
                "train",
                "--resume",
                "-o",
                str(run),
                "-v",
                str(setup["vm"]),
                "--lr",
                "3e-3",
                "--max-steps",
                "2",
                "--reschedule",
                "-q",
            ]
        )
        == 0
    )
    assert ckpt.latest_checkpoint(run).name == "step-00000002"


# ----------------------------------------------------------------------------- 6. --resume -o RUN alone


def test_resume_with_only_the_run_folder_equals_the_straight_run(
    setup, tmp_path, capsys, monkeypatch
):
    options = [
        "--lr",
        "3e-3",
        "--warmup-ratio",
        "0.25",
        "--seed",
        "3",
        "--save-every",
        "3",
        "--max-steps",
        "4",
    ]
    straight = tmp_path / "straight"
    assert main(train_args(setup, straight, *options)) == 0
    from spec_cli.trainer import run as trainer_run

    def stop_after_step_2(step):
        if step == 2:
            raise KeyboardInterrupt

    loop = trainer_run.train_loop
    monkeypatch.setattr(trainer_run, "train_loop", lambda *a: loop(*a[:4], stop_after_step_2))
    run = tmp_path / "run"
    assert (
        main(train_args(setup, run, *options)) == 130
    )  # Ctrl-C after step 2: saved, --resume continues
    monkeypatch.setattr(trainer_run, "train_loop", loop)
    assert ckpt.latest_checkpoint(run).name == "step-00000002"
    # no -v, no --cache, no option: every one is the run's own (run.json)
    assert main(["train", "--resume", "-o", str(run), "-q"]) == 0
    a, b = (
        load_file(str(ckpt.latest_checkpoint(r) / "model.safetensors")) for r in (straight, run)
    )
    assert ckpt.latest_checkpoint(run).name == "step-00000004" and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    recorded = json.loads((run / "run.json").read_text())["options"]
    assert (recorded["vocab_map"], recorded["cache"]) == (str(setup["vm"]), str(setup["cache"]))


def test_a_missing_vocab_map_is_one_line_unless_resuming(setup, tmp_path, capsys):
    run = tmp_path / "run"
    capsys.readouterr()
    assert (
        main(["train", "--cache", str(setup["cache"]), "-o", str(run), "--max-steps", "1", "-q"])
        == 1
    )
    assert error_line(capsys) == (
        "error: --vocab-map is required (with --resume, the run's own is used); pass "
        "the vocab map written by `spec build-vocab-map`"
    )
    assert not run.exists()
    assert (
        main(["train", "--resume", "--cache", str(setup["cache"]), "-o", str(run), "-q"]) == 1
    )  # no run yet
    assert error_line(capsys).startswith(
        f"error: --resume: there is no run to continue in {run}: {run} does not exist"
    )
    assert not run.exists()


def test_resume_names_a_recorded_vocab_map_that_has_gone(setup, tmp_path, capsys):
    vm = tmp_path / "inputs" / "vm.safetensors"
    vm.parent.mkdir()
    shutil.copy(setup["vm"], vm)
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "-v",
                str(vm),
                "--cache",
                str(setup["cache"]),
                "-o",
                str(run),
                "--ttt-steps",
                "2",
                "--batch-tokens",
                "512",
                "--eval-every",
                "0",
                "--max-steps",
                "2",
                "--save-every",
                "1",
                "-q",
            ]
        )
        == 0
    )
    shutil.rmtree(vm.parent)  # the inputs moved elsewhere
    capsys.readouterr()
    assert main(["train", "--resume", "-o", str(run), "-q"]) == 1
    assert error_line(capsys) == (
        f"error: the run's vocab map {vm} (recorded in {run / 'run.json'}) no longer "
        "exists; pass -v/--vocab-map with where it is now"
    )
    assert (
        main(
            [
                "train",
                "--resume",
                "-o",
                str(run),
                "-v",
                str(setup["vm"]),
                "--max-steps",
                "3",
                "--reschedule",
                "-q",
            ]
        )
        == 0
    )
    assert (
        ckpt.latest_checkpoint(run).name == "step-00000003"
    )  # typed again where it is now: resumed


def test_a_source_typed_on_resume_replaces_the_runs(setup, tmp_path):
    from spec_cli.train_options import TrainConfig
    from spec_cli.trainer.resume import resumed_config

    run = tmp_path / "run"
    run.mkdir()
    live = TrainConfig.from_options(
        vocab_map=setup["vm"], output=run, target=str(setup["target"]), data=str(setup["data"])
    )
    (run / "run.json").write_text(json.dumps({"options": live.options()}, default=str))
    given = {"output", "resume", "remote"}
    cfg = resumed_config(
        TrainConfig.from_options(output=run, resume=True, remote="http://h:1"), given
    )
    assert (cfg.data.remote, cfg.data.target, cfg.data.cache) == ("http://h:1", None, None)
    assert (cfg.data.data, cfg.data.vocab_map) == (
        str(setup["data"]),
        setup["vm"],
    )  # the rest: the run's
    cfg = resumed_config(TrainConfig.from_options(output=run, resume=True), {"output", "resume"})
    assert (cfg.data.target, cfg.data.remote) == (
        str(setup["target"]),
        None,
    )  # none typed: the run's


# ----------------------------------------------------------------------------- --attention


def test_a_fused_attention_kernel_that_fails_its_self_check(setup, tmp_path, capsys, monkeypatch):
    """On an H200 the fused kernel once failed its self-check in bf16 and every run fell back to the
    math kernel with a warning lost in the noise, at half the speed. Emulated here with a kernel that
    is 1% off: --attention fused stops before anything is written, naming the kernel and the check;
    auto trains with the math kernel and says so in one warning line; math is the math kernel."""
    from spec_cli.draft import attention
    from tests.draft import break_fused_kernel

    break_fused_kernel(monkeypatch)
    run = tmp_path / "fused"
    with pytest.warns(UserWarning, match="self-check"):
        assert main(train_args(setup, run, "--max-steps", "1", "--attention", "fused")) == 1
    assert error_line(capsys) == (
        "error: --attention fused: the fused TTT attention kernel broken failed its self-check on cpu/float32 "
        "(results differ from the math kernel); use --attention auto to train with the math kernel instead "
        "(slower; memory O(T^2))"
    )
    assert not run.exists()

    assert (
        main(train_args(setup, tmp_path / "auto", "--max-steps", "1", "--attention", "auto")) == 0
    )
    err = " ".join(
        capsys.readouterr().err.split()
    )  # rich wraps a long warning at the console's width
    warned = [w for w in err.split("warning: ")[1:] if "math attention kernel" in w]
    assert len(warned) == 1 and "broken failed its self-check on cpu/float32" in warned[0]
    assert "--attention fused stops instead" in warned[0]

    monkeypatch.setattr(attention, "fused_kernel", lambda device, dtype: attention.CPU_FLASH)
    picked = []
    real_pick = attention.pick_kernel
    monkeypatch.setattr(
        attention,
        "pick_kernel",
        lambda *a, **k: picked.append(real_pick(*a, **k).name) or real_pick(*a, **k),
    )
    assert (
        main(train_args(setup, tmp_path / "math", "--max-steps", "1", "--attention", "math")) == 0
    )
    assert picked and set(picked) == {"math"}  # every attention call of the step
    assert "math attention kernel" not in capsys.readouterr().err  # asked for: no warning


@pytest.mark.parametrize(
    "option,value,line",
    [
        ("--attention", "flex", "error: unknown --attention 'flex'; use auto, fused or math"),
        ("--precision", "half", "error: unknown --precision 'half'; use auto, bf16 or fp32"),
        ("--optimizer", "sgd", "error: unknown --optimizer 'sgd'; use adamw or muon"),
        ("--schedule", "linear", "error: unknown --schedule 'linear'; use cosine or wsd"),
    ],
)
def test_an_unknown_kernel_or_precision_is_one_line_before_anything_is_written(
    setup, tmp_path, capsys, option, value, line
):
    run = tmp_path / "run"
    assert main(train_args(setup, run, option, value)) == 1
    assert error_line(capsys) == line
    assert not run.exists()


# ----------------------------------------------------------------------------- --precision


def test_precision_auto_is_bf16_where_it_is_native(monkeypatch):
    """auto: bf16 autocast on a GPU and on a CPU with native bf16 (AMX / AVX512-BF16), fp32 where bf16
    is emulated; SPEC_TRAIN_PRECISION says what auto picks (the suite pins fp32); bad values are one line."""
    from spec_cli.errors import ConfigError
    from spec_cli.targets import loading
    from spec_cli.trainer.device import step_precision

    monkeypatch.delenv("SPEC_TRAIN_PRECISION")
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    for native, want in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(loading, "fast_bf16", lambda device, native=native: native)
        assert step_precision("auto", cpu) is want and step_precision("auto", gpu) is want
        assert step_precision("fp32", cpu) is None and step_precision("bf16", cpu) is torch.bfloat16
    monkeypatch.setenv("SPEC_TRAIN_PRECISION", "fp32")
    assert step_precision("auto", gpu) is None and step_precision("bf16", gpu) is torch.bfloat16
    monkeypatch.setenv("SPEC_TRAIN_PRECISION", "fp16")
    with pytest.raises(ConfigError) as refused:
        step_precision("auto", cpu)
    assert (
        refused.value.one_line()
        == "unknown SPEC_TRAIN_PRECISION 'fp16'; set it to bf16 or fp32, or unset it"
    )
    with pytest.raises(ConfigError) as refused:
        step_precision("half", cpu)
    assert refused.value.one_line() == "unknown --precision 'half'; use auto, bf16 or fp32"


def test_bf16_training_through_the_cli_is_close_to_fp32(setup, tmp_path, capsys):
    """--precision bf16 runs the step under autocast on the CPU: the losses move off fp32's by bf16
    rounding only (measured here: 0.9e-5 to 5.5e-5 relative over 3 steps), and the training line says bf16."""
    losses = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        args = train_args(
            setup, run, "--max-steps", "3", "--eval-fraction", "0", "--precision", precision
        )
        assert main([a for a in args if a != "-q"]) == 0  # not -q: the training line
        out = " ".join(capsys.readouterr().out.split())
        assert f", {precision}, attention " in out
        records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        losses[precision] = [r["loss"] for r in records if r.get("split") == "train"]
    assert len(losses["fp32"]) == len(losses["bf16"]) == 3
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert a != b and abs(a - b) <= 1e-3 * abs(a), losses


def test_reading_the_cache_ahead_trains_the_same(setup, tmp_path):
    """--prefetch 2 (the default: a thread reads the cache ahead) and --prefetch 0 (each batch read when
    needed) train the same draft bit for bit, evaluation (which reads the same cache) included."""
    runs = {}
    for prefetch in ("0", "2"):
        run = tmp_path / f"prefetch-{prefetch}"
        assert (
            main(
                train_args(
                    setup, run, "--max-steps", "3", "--eval-every", "2", "--prefetch", prefetch
                )
            )
            == 0
        )
        runs[prefetch] = run
    logs = [(r / "log.jsonl").read_text() for r in runs.values()]
    strip = [
        [
            {
                k: v
                for k, v in json.loads(line).items()
                if "time" not in k and "per_s" not in k and "eta" not in k and "memory" not in k
            }
            for line in log.splitlines()
        ]
        for log in logs
    ]
    assert strip[0] == strip[1]
    weights = [
        load_file(str(ckpt.latest_checkpoint(r) / "model.safetensors")) for r in runs.values()
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_cache_reading_thread_does_host_work_only(setup):
    """What the read-ahead thread runs (CacheBackend.read_host) makes no tensor on the backend's device,
    the meta device standing for the GPU here; the decoding (`finish`, the loop's thread) runs there.
    A reading thread that decoded on the GPU and brought the [T, Vd] distribution back to the host to
    pin it made an H200 step 2-3.6x slower."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from spec_cli.data.batching import collate
    from spec_cli.targets.cache_backend import CacheBackend

    class Devices(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.seen.add(t.device.type)
            return out

    backend = CacheBackend(setup["cache"], device="meta")
    try:
        ids, am, lm = collate(backend.tokens(), [0, 1, 2])
        with Devices() as mode:
            host = backend.read_host(ids, am, lm)
        assert mode.seen == {"cpu"}
        assert {t.device.type for t in host.tensors.values()} == {"cpu"}
        batch = backend.finish(host.to(torch.device("meta")))
        assert {t.device.type for t in batch.tensors().values()} == {"meta"}
        assert batch.target_p.shape[:2] == ids.shape
    finally:
        backend.close()


def test_a_cpu_capped_to_avx2_has_no_fast_bf16(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 (torch's kernels) or ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's matmuls) make bf16
    emulated whatever the CPU has: auto then trains, regenerates and precomputes in fp32, as on an
    AVX2-only machine (how this project measures that class of CPU on a faster one)."""
    from spec_cli.targets import loading

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert loading.fast_bf16(cpu)
    for isa, fast in (
        ("AVX2", False),
        ("AVX512_CORE", False),
        ("AVX512_CORE_BF16", True),
        ("ALL", True),
    ):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert loading.fast_bf16(cpu) is fast, isa
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not loading.fast_bf16(cpu)


def test_a_draft_window_that_cannot_work_is_one_line_before_anything_is_written(
    setup, tmp_path, capsys
):
    run = tmp_path / "run"
    assert main(train_args(setup, run, "--draft-window", "2")) == 1
    assert error_line(capsys) == (
        "error: --draft-window 2 does not reach over the 2 TTT steps: the last step's "
        "query would see none of the context; use --draft-window 3 or more "
        "(speculators: 2048)"
    )
    assert main(train_args(setup, run, "--draft-window", "8", "--algorithm", "peagle")) == 1
    assert error_line(capsys).startswith(
        "error: --draft-window: P-EAGLE drafts have no sliding-window attention"
    )
    assert not run.exists()


def test_a_draft_window_is_part_of_the_draft(setup, tmp_path, capsys):
    """The window goes into the draft's config (what export and eval read); a resume with another is refused."""
    run = tmp_path / "run"
    assert main(train_args(setup, run, "--draft-window", "5", "--max-steps", "2")) == 0
    latest = ckpt.latest_checkpoint(run)
    assert json.loads((latest / "config.json").read_text())["sliding_window"] == 5
    capsys.readouterr()
    assert main(train_args(setup, run, "--draft-window", "7", "--max-steps", "2", "--resume")) == 1
    assert "different draft-window: the run used 5, now 7" in error_line(capsys)


def test_context_parallel_that_cannot_run_is_one_line_before_anything_is_written(
    setup, tmp_path, capsys
):
    run = tmp_path / "run"
    assert main(train_args(setup, run, "--context-parallel", "2", "--algorithm", "dflash")) == 1
    assert error_line(capsys) == (
        "error: --context-parallel: DFlash does not split its rows over ranks yet (its "
        "objective attends across whole blocks of a row); drop --context-parallel, or "
        "train --algorithm eagle3, eagle, peagle, msd"
    )
    assert (
        main(train_args(setup, run, "--context-parallel", "2")) == 1
    )  # one process: nothing to split over
    assert error_line(capsys) == (
        "error: --context-parallel 2 does not divide the 1 torchrun processes; launch "
        "a multiple of it (torchrun --nproc-per-node), or choose a divisor"
    )
    assert not run.exists()
    live = [
        "train",
        "-v",
        str(setup["vm"]),
        "--target",
        str(setup["target"]),
        "--data",
        str(setup["data"]),
        "-o",
        str(run),
        "-q",
        "--context-parallel",
        "2",
    ]
    assert main([*live, "--stream"]) == 1  # the target runs once per group, in step with the ranks
    assert error_line(capsys) == (
        "error: with --context-parallel a live target runs once per group, on its first "
        "rank, in step with the others: --stream's producer threads run each rank at "
        "its own pace; drop --stream, or precompute a feature cache"
    )
    assert main([*live, "--target-parallel", "tensor"]) == 1
    assert (
        "--target-parallel tensor shards it over every rank; drop --target-parallel tensor"
        in error_line(capsys)
    )
    assert not run.exists()


# ----------------------------------------------------------------------------- a stop, a resume elsewhere


def sigterm_during_step(monkeypatch, n: int) -> None:
    """SIGTERM to this process during its n-th optimizer update (in-process: deterministic)."""
    from spec_cli.trainer.trainer import Trainer

    real, done = Trainer.optimizer_step, [0]

    def optimizer_step(self):
        out = real(self)
        done[0] += 1
        if done[0] == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "optimizer_step", optimizer_step)


def logged_steps(run: Path) -> list[int]:
    """The steps log.jsonl's train records cover, in order (a record covers its steps_in_record steps)."""
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [
        s
        for r in records
        if r["split"] == "train"
        for s in range(r["step"] - r["steps_in_record"] + 1, r["step"] + 1)
    ]


@pytest.mark.parametrize("log_every, eval_every, saved", [("1", "0", 4), ("2", "3", 3)])
def test_a_stopped_and_resumed_run_logs_every_step_once(
    setup, tmp_path, monkeypatch, log_every, eval_every, saved
):
    """SIGTERM during step 3's update is answered at step 4's host sync (or, at an evaluation step, at once):
    the step it stops after is saved and its train record written, so the resumed run (which logs from the
    step after) leaves no step out of log.jsonl and logs none twice."""
    run = tmp_path / "run"
    args = train_args(
        setup,
        run,
        "--max-steps",
        "6",
        "--save-every",
        "100",
        "--log-every",
        log_every,
        "--eval-every",
        eval_every,
    )
    with monkeypatch.context() as mp:
        sigterm_during_step(mp, 3)
        assert main(args) == 143
    assert [d.name for d in ckpt.checkpoint_dirs(run)] == [f"step-{saved:08d}"]
    assert logged_steps(run) == list(range(1, saved + 1))
    assert main([*args, "--resume"]) == 0
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]


def test_a_resume_over_fewer_processes_keeps_the_runs_batch(setup, tmp_path, capsys, monkeypatch):
    """A run saved by 2 processes x --grad-accum 1 (emulated: one process x 2 micro-batches, with the
    trainer_state.json and run.json two ranks write) resumed by one process: --grad-accum 2 keeps its 2
    micro-batches a step, one line says so, and the weights end where a straight --grad-accum 2 run's do.
    A number of processes that cannot split them, or a typed --grad-accum that changes them, is refused."""
    options = ["--lr", "3e-3", "--max-steps", "3", "--save-every", "100", "--grad-accum", "2"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert main(train_args(setup, straight, *options)) == 0
    assert (
        main(train_args(setup, run, *options, "--max-time", "0.001s")) == 0
    )  # stops after step 1, saved
    first = ckpt.latest_checkpoint(run)
    state = json.loads((first / "trainer_state.json").read_text())
    assert (state["step"], state["micro_batches_done"]) == (1, 2)
    two_ranks = {**state, "world_size": 2, "grad_accum": 1, "parallel": "ddp"}
    (first / "trainer_state.json").write_text(json.dumps(two_ranks))
    recorded = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(
        json.dumps({**recorded, "options": {**recorded["options"], "grad_accum": 1}})
    )
    capsys.readouterr()

    assert main(["train", "--resume", "-o", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "--resume over 1 process of a run trained over 2: --grad-accum 2 keeps its 2 micro-batches a step"
        in out
    ), out
    latest = ckpt.latest_checkpoint(run)
    assert latest.name == "step-00000003"
    assert json.loads((latest / "trainer_state.json").read_text())["micro_batches_done"] == 6
    a, b = (
        load_file(str(ckpt.latest_checkpoint(r) / "model.safetensors")) for r in (straight, run)
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    before = files(run)
    resume = ["train", "--resume", "-o", str(run), "--max-steps", "4", "--reschedule", "-q"]
    assert main([*resume, "--grad-accum", "1"]) == 1
    assert error_line(capsys) == (
        "error: --resume with --grad-accum 1 over 1 process: 1 micro-batch a step, and the "
        "run's steps take 2 micro-batches (1 process x --grad-accum 2); drop --grad-accum "
        "(--grad-accum 2 keeps the run's batch here), or start a new run folder"
    )
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(resume) == 1
    assert error_line(capsys) == (
        "error: --resume over 3 processes: the run's steps take 2 micro-batches (1 process "
        "x --grad-accum 2), which 3 data-parallel replicas cannot split evenly; resume "
        "over 1 or 2 processes (torchrun --nproc-per-node)"
    )
    assert files(run) == before


def test_a_resume_where_auto_picks_another_precision_says_so_and_records_it(
    setup, tmp_path, capsys, monkeypatch
):
    """--precision auto on two machines (SPEC_TRAIN_PRECISION emulates them): started in bf16, resumed in
    fp32. run.json records the choice beside the option, each checkpoint the precision it was trained in,
    and the resume says it changed, in one line."""
    run = tmp_path / "run"
    monkeypatch.setenv("SPEC_TRAIN_PRECISION", "bf16")
    assert (
        main(train_args(setup, run, "--max-steps", "2", "--max-time", "0.001s")) == 0
    )  # stops after step 1
    recorded = json.loads((run / "run.json").read_text())
    assert (recorded["options"]["precision"], recorded["chosen"]["precision"]) == ("auto", "bf16")
    first = ckpt.latest_checkpoint(run)
    assert json.loads((first / "trainer_state.json").read_text())["precision"] == "bf16"
    capsys.readouterr()

    monkeypatch.setenv("SPEC_TRAIN_PRECISION", "fp32")
    assert main(["train", "--resume", "-o", str(run), "-q"]) == 0
    assert " ".join(capsys.readouterr().err.split()) == (
        "warning: --resume: step-00000001 was trained in bf16, and this run trains in fp32 (--precision auto "
        "follows SPEC_TRAIN_PRECISION=fp32); pass --precision bf16 to go on in bf16"
    )
    recorded = json.loads((run / "run.json").read_text())
    assert (recorded["options"]["precision"], recorded["chosen"]["precision"]) == ("auto", "fp32")
    assert (
        json.loads((ckpt.latest_checkpoint(run) / "trainer_state.json").read_text())["precision"]
        == "fp32"
    )
