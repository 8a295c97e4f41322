"""spec precompute: cache == live backend (bit for bit), resume after kill -9, mismatches. (torchrun:
tests/test_distributed.py.)"""

import contextlib
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from spec_cli.artifacts import feature_cache as fc
from spec_cli.artifacts.vocab_map import load_vocab_map
from spec_cli.cli import main
from spec_cli.data.batching import collate
from spec_cli.errors import ArtifactError
from spec_cli.targets.cache_backend import CacheBackend
from spec_cli.targets.hf_backend import HFTargetBackend
from tests import tiny
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_llama_dir):
    """Chat data + a vocab map for the tiny Llama target (built through the CLI)."""
    root = tmp_path_factory.mktemp("precompute")
    rng = random.Random(7)
    data = write_jsonl(root / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(60)])
    vm = root / "vm.safetensors"
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(root / "home"))
    try:
        assert (
            main(
                [
                    "build-vocab-map",
                    "-t",
                    str(tiny_llama_dir),
                    "-d",
                    str(data),
                    "--draft-vocab-size",
                    "64",
                    "-o",
                    str(vm),
                    "-q",
                ]
            )
            == 0
        )
    finally:
        mp.undo()
    return {"data": data, "vm": vm, "root": root}


def precompute(target, workdir, out, *extra) -> int:
    return main(
        [
            "precompute",
            "-t",
            str(target),
            "-d",
            str(workdir["data"]),
            "-v",
            str(workdir["vm"]),
            "-o",
            str(out),
            "--batch-tokens",
            "512",
            "--shard-tokens",
            "600",
            "-q",
            *extra,
        ]
    )


def digest(folder: Path) -> dict:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.name != ".spec.lock"
    }  # the lock file names the process that wrote the cache


@pytest.mark.parametrize("encoding", ["hidden", "probs"])
def test_cache_batches_equal_live_batches_bit_for_bit(tiny_llama_dir, workdir, tmp_path, encoding):
    out = tmp_path / "cache"
    assert precompute(tiny_llama_dir, workdir, out, "--encoding", encoding) == 0
    cache = CacheBackend(out, verify=True)
    live = HFTargetBackend(tiny_llama_dir, device="cpu", dtype="fp32")
    vocab_map = load_vocab_map(workdir["vm"])
    live.set_vocab_mapping(vocab_map.selected_token_ids)
    cache.set_vocab_mapping(vocab_map.selected_token_ids)
    assert torch.equal(cache.get_input_embeddings(), live.get_input_embeddings())
    tokens = cache.tokens()
    plan = cache.plan()
    assert len(plan) > 3 and sum(len(b) for b in plan) == cache.reader.manifest["num_samples"]
    for indices in plan:
        ids, am, lm = collate(tokens, indices)
        got, want = cache.generate_batch(ids, am, lm), live.generate_batch(ids, am, lm)
        for name, tensor in want.tensors().items():
            assert torch.equal(getattr(got, name), tensor), (encoding, name)
    live.close()


def test_bf16_cache_is_within_bf16_rounding(tiny_llama_dir, workdir, tmp_path):
    out = tmp_path / "cache16"
    assert precompute(tiny_llama_dir, workdir, out, "--encoding", "probs", "--dtype", "bf16") == 0
    cache = CacheBackend(out)
    live = HFTargetBackend(tiny_llama_dir, device="cpu", dtype="bf16")
    live.set_vocab_mapping(load_vocab_map(workdir["vm"]).selected_token_ids)
    ids, am, lm = collate(cache.tokens(), cache.plan()[0])
    got, want = cache.generate_batch(ids, am, lm), live.generate_batch(ids, am, lm)
    assert torch.equal(got.aux_hidden, want.aux_hidden) and torch.equal(
        got.target_ids, want.target_ids
    )
    torch.testing.assert_close(got.target_p, want.target_p, rtol=2**-7, atol=1e-6)


def test_the_bar_counts_tokens_and_advances_once_per_target_batch(
    tiny_llama_dir, workdir, tmp_path, monkeypatch
):
    from spec_cli.stages import precompute as stage

    bars = []

    @contextlib.contextmanager
    def recording(description, total, *, unit=None, rate=None):
        bar = SimpleNamespace(total=total, unit=unit, advances=[])
        bar.advance = lambda n=1, count=0: bar.advances.append(n)
        bars.append(bar)
        yield bar

    monkeypatch.setattr(stage, "progress", recording)
    out = tmp_path / "cache"
    assert precompute(tiny_llama_dir, workdir, out) == 0
    manifest = fc.read_manifest(out)
    [bar] = bars
    assert bar.unit == "tokens" and bar.total == manifest["num_tokens"]  # its rate is in tokens/s
    assert len(bar.advances) == manifest["num_batches"] > 3 and sum(bar.advances) == bar.total


def test_the_summary_says_on_how_many_threads_the_throughput_was_measured(
    tiny_llama_dir, workdir, tmp_path, capsys
):
    before = torch.get_num_threads()
    assert (
        main(
            [
                "precompute",
                "-t",
                str(tiny_llama_dir),
                "-d",
                str(workdir["data"]),
                "-v",
                str(workdir["vm"]),
                "-o",
                str(tmp_path / "cache"),
                "--batch-tokens",
                "512",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert "tokens/s on 1 thread (--threads 1)" in " ".join(capsys.readouterr().out.split())
    assert torch.get_num_threads() == before  # the stage's choice does not leak into what runs next
    assert "threads" not in fc.read_manifest(
        tmp_path / "cache"
    )  # reruns and torchrun: the same bytes


def test_off_a_terminal_the_tokens_done_are_logged_in_lines(
    tiny_llama_dir, workdir, tmp_path, capsys, monkeypatch
):
    """stdout to a file or a pipe (capsys here): plain lines of tokens done of the total, with the
    rate and the time left (a line at every target batch: the interval is set to 0), then the
    end."""
    import spec_cli.console as console

    monkeypatch.setattr(console, "LINE_INTERVAL_S", 0.0)
    out = tmp_path / "cache"
    assert (
        main(
            [
                "precompute",
                "-t",
                str(tiny_llama_dir),
                "-d",
                str(workdir["data"]),
                "-v",
                str(workdir["vm"]),
                "-o",
                str(out),
                "--batch-tokens",
                "512",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\r" not in text
    n = fc.read_manifest(out)["num_tokens"]
    assert n < 10_000  # said in full below 10k
    lines = [line for line in text.splitlines() if line.startswith("precompute: ")]
    assert lines[0] == f"precompute: {n} tokens to do"
    said = [
        re.fullmatch(
            rf"precompute: (\d+)/{n} tokens, [\d.]+k? tokens/s, \S+ so far, \S+ left", line
        )
        for line in lines[1:-1]
    ]
    assert len(said) >= 3 and all(said), lines  # one per target batch; the last: the end line
    done = [int(m.group(1)) for m in said]
    assert done == sorted(done) and 0 < done[-1] < n
    assert re.fullmatch(rf"precompute: {n}/{n} tokens, [\d.]+k? tokens/s, done in \S+", lines[-1])


@pytest.mark.slow
def test_resume_after_kill_9_gives_the_identical_cache(tiny_llama_dir, workdir, tmp_path):
    straight = tmp_path / "straight"
    assert precompute(tiny_llama_dir, workdir, straight) == 0
    n_shards = fc.read_manifest(straight)["num_shards"]
    assert n_shards >= 4

    resumed = tmp_path / "resumed"
    cmd = [
        sys.executable,
        "-m",
        "spec_cli.cli",
        "precompute",
        "-t",
        str(tiny_llama_dir),
        "-d",
        str(workdir["data"]),
        "-v",
        str(workdir["vm"]),
        "-o",
        str(resumed),
        "--batch-tokens",
        "512",
        "--shard-tokens",
        "600",
        "-q",
    ]
    env = {**os.environ, "SPEC_TEST_SHARD_DELAY": "0.5"}
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.time() + 120
    while not (resumed / "shard-00001.json").exists():
        assert time.time() < deadline and proc.poll() is None, "precompute did not get going"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = {p.name for p in resumed.glob("shard-*.safetensors")}
    assert 2 <= len(done_before) < n_shards and not (resumed / fc.MANIFEST).exists()
    mtimes = {p.name: p.stat().st_mtime_ns for p in resumed.glob("shard-*.safetensors")}
    # rerunning resumes: finished shards are kept (not rewritten), the rest computed
    env.pop("SPEC_TEST_SHARD_DELAY")
    assert subprocess.run(cmd, env=env).returncode == 0
    for name, mtime in mtimes.items():
        assert (resumed / name).stat().st_mtime_ns == mtime
    assert digest(resumed) == digest(straight)
    assert not list(resumed.glob(".*tmp"))  # no half-written files left behind


def test_damaged_shard_is_recomputed(tiny_llama_dir, workdir, tmp_path):
    out = tmp_path / "c"
    assert precompute(tiny_llama_dir, workdir, out) == 0
    reference = digest(out)
    (out / fc.MANIFEST).unlink()
    shard = out / "shard-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert precompute(tiny_llama_dir, workdir, out) == 0
    assert digest(out) == reference


def test_a_rerun_checks_the_shards_it_reuses_and_recomputes_a_damaged_one(
    tiny_llama_dir, workdir, tmp_path, capsys
):
    out = tmp_path / "c"
    assert precompute(tiny_llama_dir, workdir, out) == 0
    reference = digest(out)
    n = fc.read_manifest(out)["num_shards"]
    shard = out / fc.shard_name(2)
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # the same size: only its checksum tells
    shard.write_bytes(bytes(data))
    assert main(["inspect", str(out), "--verify"]) == 1
    capsys.readouterr()
    assert (
        main(
            [
                "precompute",
                "-t",
                str(tiny_llama_dir),
                "-d",
                str(workdir["data"]),
                "-v",
                str(workdir["vm"]),
                "-o",
                str(out),
                "--batch-tokens",
                "512",
                "--shard-tokens",
                "600",
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    assert " ".join(printed.err.split()) == (
        f"warning: feature cache {out}: shard-00002.safetensors fails its checksum: recomputing it"
    )
    assert f"shards {n} (1 computed, {n - 1} reused)" in " ".join(printed.out.split())
    assert digest(out) == reference
    assert main(["inspect", str(out), "--verify"]) == 0


def test_a_different_cache_is_never_mixed_in(
    tiny_llama_dir, tiny_tokenizer_dirs, workdir, tmp_path, capsys
):
    out = tmp_path / "c"
    assert precompute(tiny_llama_dir, workdir, out) == 0
    assert precompute(tiny_llama_dir, workdir, out, "--aux-layers", "1,2,3") == 1
    assert "aux layers: cache has [1, 3, 4], this run has [1, 2, 3]" in capsys.readouterr().err
    (out / fc.MANIFEST).unlink()  # an interrupted cache is checked shard by shard
    assert precompute(tiny_llama_dir, workdir, out, "--encoding", "probs") == 1
    assert "encoding" in capsys.readouterr().err
    # a vocab map from another tokenizer is refused before any work
    other = tmp_path / "other.safetensors"
    assert (
        main(
            [
                "build-vocab-map",
                "-t",
                str(tiny_tokenizer_dirs["chatml"]),
                "-d",
                str(workdir["data"]),
                "--draft-vocab-size",
                "64",
                "-o",
                str(other),
                "-q",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "precompute",
                "-t",
                str(tiny_llama_dir),
                "-d",
                str(workdir["data"]),
                "-v",
                str(other),
                "-o",
                str(tmp_path / "x"),
                "-q",
            ]
        )
        == 1
    )
    assert "different tokenizer" in capsys.readouterr().err
    assert precompute(tiny_llama_dir, workdir, out, "--no-resume", "--aux-layers", "1,2,3") == 0
    assert fc.read_manifest(out)["aux_layers"] == [1, 2, 3]


def test_bad_aux_layers_and_full_disk_fail_before_work(
    tiny_llama_dir, workdir, tmp_path, capsys, monkeypatch
):
    assert precompute(tiny_llama_dir, workdir, tmp_path / "a", "--aux-layers", "1,2,8") == 1
    assert "out of range: the target has 8 decoder layers" in capsys.readouterr().err
    import spec_cli.stages.precompute as stage

    monkeypatch.setattr(
        stage.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1000)
    )
    assert precompute(tiny_llama_dir, workdir, tmp_path / "b") == 1
    assert "1.00 KB free" in " ".join(capsys.readouterr().err.split())
    assert not list((tmp_path / "b").glob("shard-*"))


# ----------------------------------------------------------------------------- size and storage dtype


def _run(target, workdir, out, **kw):
    from spec_cli.stages import precompute as stage

    return stage.run(
        stage.PrecomputeConfig(
            target=str(target),
            data=str(workdir["data"]),
            vocab_map=workdir["vm"],
            output=out,
            batch_tokens=512,
            shard_tokens=600,
            **kw,
        )
    )


@pytest.mark.parametrize(
    "encoding,storage", [("hidden", None), ("probs", None), ("hidden", "bf16")]
)
def test_the_estimate_counts_every_byte_the_cache_holds(
    tiny_llama_dir, workdir, tmp_path, encoding, storage, capsys
):
    """Shards, sidecars, head.safetensors (embed_tokens [V, H] + the draft-vocab rows of lm_head) and
    the manifest: the estimate the disk check uses is what lands on disk."""
    out = tmp_path / "cache"
    result = _run(tiny_llama_dir, workdir, out, encoding=encoding, storage_dtype=storage)
    on_disk = sum(
        p.stat().st_size for p in out.iterdir() if p.name != ".spec.lock"
    )  # the lock is no cache byte
    assert result.disk["total"] == on_disk
    head = (out / fc.HEAD).stat().st_size
    assert result.disk["head"] == head == result.manifest["head_bytes"]
    assert head > 0.01 * on_disk  # the part the estimate used to leave out
    assert abs(result.estimated_bytes - on_disk) <= 0.002 * on_disk, (
        result.estimated_bytes,
        on_disk,
    )
    m = result.manifest
    assert (
        abs(
            fc.head_bytes(m["vocab_size"], m["hidden_size"], m["draft_vocab_size"], m["dtype"])
            - head
        )
        < 256
    )
    from spec_cli.console import human_bytes, set_quiet
    from spec_cli.ui import print_precompute_summary

    set_quiet(False)  # (an earlier `-q` in this process)
    print_precompute_summary(result)
    printed = " ".join(capsys.readouterr().out.split())
    assert f"{human_bytes(on_disk)} (shards" in printed and f"head {human_bytes(head)}" in printed
    assert f"estimated {human_bytes(result.estimated_bytes)}" in printed


def test_the_disk_check_counts_the_head_too(tiny_llama_dir, workdir, tmp_path, capsys, monkeypatch):
    import spec_cli.stages.precompute as stage

    estimated = _run(tiny_llama_dir, workdir, tmp_path / "sized").estimated_bytes
    head = (tmp_path / "sized" / fc.HEAD).stat().st_size
    free = {"bytes": estimated - head // 2}  # room for every shard, not for the head as well
    monkeypatch.setattr(
        stage.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, free["bytes"])
    )
    assert precompute(tiny_llama_dir, workdir, tmp_path / "b") == 1
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "the cache needs about" in err
        and "head" in err
        and "free" in err
        and "--storage-dtype bf16" in err
    )
    assert not list((tmp_path / "b").glob("shard-*")) and not (tmp_path / "b" / fc.HEAD).exists()
    free["bytes"] = estimated + 1024
    assert precompute(tiny_llama_dir, workdir, tmp_path / "b") == 0


def test_bf16_storage_halves_the_features_trains_and_is_part_of_the_identity(
    tiny_llama_dir, workdir, tmp_path, capsys
):
    from safetensors import safe_open

    from spec_cli.stages import train

    full, half = tmp_path / "fp32", tmp_path / "bf16"
    assert precompute(tiny_llama_dir, workdir, full) == 0
    assert precompute(tiny_llama_dir, workdir, half, "--storage-dtype", "bf16") == 0
    a, b = fc.read_manifest(full), fc.read_manifest(half)
    assert (a["dtype"], a["storage_dtype"], b["dtype"], b["storage_dtype"]) == (
        "float32",
        "float32",
        "float32",
        "bfloat16",
    )
    H = a["hidden_size"]
    assert (
        a["bytes_per_token"] - b["bytes_per_token"] == 4 * H * 2
    )  # aux [3H] + final [H]: 4 -> 2 bytes

    def feature_bytes(folder):
        total = 0
        for shard in sorted(folder.glob("shard-*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                for name in ("aux_hidden", "final_hidden"):
                    t = f.get_tensor(name)
                    assert t.dtype == (torch.bfloat16 if folder == half else torch.float32)
                    total += t.numel() * t.element_size()
        return total

    assert feature_bytes(half) * 2 == feature_bytes(full)
    assert b["bytes"] < 0.55 * a["bytes"]  # the shards on disk: nearly half (ids, argmax, lse stay)
    # the trainer's backend upcasts: the fp32 features rounded to bf16, nothing else changed
    cached, rounded = CacheBackend(half), CacheBackend(full)
    ids, am, lm = collate(cached.tokens(), cached.plan()[0])
    got, want = cached.generate_batch(ids, am, lm), rounded.generate_batch(ids, am, lm)
    assert got.aux_hidden.dtype == torch.float32
    assert torch.equal(got.aux_hidden, want.aux_hidden.bfloat16().float())
    assert torch.equal(got.target_ids, want.target_ids) and torch.equal(
        got.position_mask, want.position_mask
    )
    torch.testing.assert_close(got.target_p, want.target_p, rtol=0.05, atol=2e-3)
    assert not torch.equal(got.target_p, want.target_p)
    # spec inspect shows it; training from it works
    assert main(["inspect", str(half)]) == 0
    assert "storage_dtype: bfloat16" in capsys.readouterr().out
    result = train.run(
        train.TrainConfig.from_options(
            vocab_map=workdir["vm"],
            output=tmp_path / "run",
            cache=half,
            ttt_steps=2,
            max_steps=3,
            batch_tokens=512,
            eval_every=0,
            log_every=1,
        )
    )
    assert result.steps == 3 and 0 < result.final_train["loss"] < float("inf")
    # another storage dtype is another cache: refused on resume, naming the option
    assert precompute(tiny_llama_dir, workdir, half) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "storage dtype: cache has 'bfloat16', this run has 'float32' (--storage-dtype)" in err
    (half / fc.MANIFEST).unlink()  # an interrupted cache: each shard is checked
    assert precompute(tiny_llama_dir, workdir, half, "--storage-dtype", "fp16") == 1
    assert "(--storage-dtype)" in capsys.readouterr().err
    assert (
        precompute(tiny_llama_dir, workdir, half, "--storage-dtype", "bf16") == 0
    )  # the same: resumes
    assert precompute(tiny_llama_dir, workdir, tmp_path / "x", "--storage-dtype", "int8") == 1
    assert "unknown --storage-dtype 'int8'" in capsys.readouterr().err


def test_caches_from_before_storage_dtype_keep_their_identity_and_fp16_refuses_overflow():
    from spec_cli.stages.precompute import _stored

    old = {
        "dtype": "float32"
    }  # a manifest written before storage_dtype existed stored the model dtype
    expected = {k: old.get(k) for k in fc.IDENTITY_KEYS}
    assert (
        fc.identity_mismatch({**expected, "dtype": "float32", "storage_dtype": "float32"}, old)
        is None
    )
    why = fc.identity_mismatch({**expected, "dtype": "float32", "storage_dtype": "bfloat16"}, old)
    assert why == "storage dtype: cache has 'float32', this run has 'bfloat16' (--storage-dtype)"
    assert torch.equal(
        _stored(torch.tensor([3.0, -70000.0]), torch.bfloat16),
        torch.tensor([3.0, -70000.0]).bfloat16(),
    )
    with pytest.raises(ArtifactError, match="beyond fp16's range"):
        _stored(torch.tensor([3.0, -70000.0]), torch.float16)
