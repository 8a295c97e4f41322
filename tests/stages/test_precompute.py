"""spec precompute: cache == live backend (bit for bit), resume after kill -9, mismatches, torchrun."""

import contextlib
import hashlib
import os
import random
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
from spec_cli.cli import main
from spec_cli.data.batching import collate
from spec_cli.errors import ArtifactError
from spec_cli.target.cache_backend import CacheBackend
from spec_cli.target.hf_backend import HFTargetBackend
from spec_cli.artifacts.vocab_map import load_vocab_map
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
        assert main(["build-vocab-map", "-t", str(tiny_llama_dir), "-d", str(data), "--draft-vocab-size",
                     "64", "-o", str(vm), "-q"]) == 0
    finally:
        mp.undo()
    return {"data": data, "vm": vm, "root": root}


def precompute(target, workdir, out, *extra) -> int:
    return main(["precompute", "-t", str(target), "-d", str(workdir["data"]), "-v", str(workdir["vm"]),
                 "-o", str(out), "--batch-tokens", "512", "--shard-tokens", "600", "-q", *extra])


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


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
    assert torch.equal(got.aux_hidden, want.aux_hidden) and torch.equal(got.target_ids, want.target_ids)
    torch.testing.assert_close(got.target_p, want.target_p, rtol=2 ** -7, atol=1e-6)


def test_the_bar_counts_tokens_and_advances_once_per_target_batch(tiny_llama_dir, workdir, tmp_path,
                                                                  monkeypatch):
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


def test_the_summary_says_on_how_many_threads_the_throughput_was_measured(tiny_llama_dir, workdir, tmp_path,
                                                                          capsys):
    before = torch.get_num_threads()
    assert main(["precompute", "-t", str(tiny_llama_dir), "-d", str(workdir["data"]), "-v", str(workdir["vm"]),
                 "-o", str(tmp_path / "cache"), "--batch-tokens", "512", "--threads", "1"]) == 0
    assert "tokens/s on 1 thread (--threads 1)" in " ".join(capsys.readouterr().out.split())
    assert torch.get_num_threads() == before  # the stage's choice does not leak into what runs next
    assert "threads" not in fc.read_manifest(tmp_path / "cache")  # reruns and torchrun: the same bytes


def test_resume_after_kill_9_gives_the_identical_cache(tiny_llama_dir, workdir, tmp_path):
    straight = tmp_path / "straight"
    assert precompute(tiny_llama_dir, workdir, straight) == 0
    n_shards = fc.read_manifest(straight)["num_shards"]
    assert n_shards >= 4

    resumed = tmp_path / "resumed"
    cmd = [sys.executable, "-m", "spec_cli.cli", "precompute", "-t", str(tiny_llama_dir), "-d",
           str(workdir["data"]), "-v", str(workdir["vm"]), "-o", str(resumed), "--batch-tokens", "512",
           "--shard-tokens", "600", "-q"]
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


def test_a_different_cache_is_never_mixed_in(tiny_llama_dir, tiny_tokenizer_dirs, workdir, tmp_path,
                                             capsys):
    out = tmp_path / "c"
    assert precompute(tiny_llama_dir, workdir, out) == 0
    assert precompute(tiny_llama_dir, workdir, out, "--aux-layers", "1,2,3") == 1
    assert "aux layers: cache has [1, 3, 4], this run has [1, 2, 3]" in capsys.readouterr().err
    (out / fc.MANIFEST).unlink()  # an interrupted cache is checked shard by shard
    assert precompute(tiny_llama_dir, workdir, out, "--encoding", "probs") == 1
    assert "encoding" in capsys.readouterr().err
    # a vocab map from another tokenizer is refused before any work
    other = tmp_path / "other.safetensors"
    assert main(["build-vocab-map", "-t", str(tiny_tokenizer_dirs["chatml"]), "-d", str(workdir["data"]),
                 "--draft-vocab-size", "64", "-o", str(other), "-q"]) == 0
    assert main(["precompute", "-t", str(tiny_llama_dir), "-d", str(workdir["data"]), "-v", str(other),
                 "-o", str(tmp_path / "x"), "-q"]) == 1
    assert "different tokenizer" in capsys.readouterr().err
    assert precompute(tiny_llama_dir, workdir, out, "--no-resume", "--aux-layers", "1,2,3") == 0
    assert fc.read_manifest(out)["aux_layers"] == [1, 2, 3]


def test_bad_aux_layers_and_full_disk_fail_before_work(tiny_llama_dir, workdir, tmp_path, capsys,
                                                       monkeypatch):
    assert precompute(tiny_llama_dir, workdir, tmp_path / "a", "--aux-layers", "1,2,8") == 1
    assert "out of range: the target has 8 decoder layers" in capsys.readouterr().err
    import spec_cli.stages.precompute as stage

    monkeypatch.setattr(stage.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1000))
    assert precompute(tiny_llama_dir, workdir, tmp_path / "b") == 1
    assert "GB free" in capsys.readouterr().err
    assert not list((tmp_path / "b").glob("shard-*"))


def test_torchrun_two_processes_write_the_same_cache(tiny_llama_dir, workdir, tmp_path):
    single = tmp_path / "single"
    assert precompute(tiny_llama_dir, workdir, single) == 0
    double = tmp_path / "double"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           "29517", "-m", "spec_cli.cli", "precompute", "-t", str(tiny_llama_dir), "-d",
           str(workdir["data"]), "-v", str(workdir["vm"]), "-o", str(double), "--batch-tokens", "512",
           "--shard-tokens", "600", "-q"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert digest(double) == digest(single)
