"""A live target sharded over the ranks of a machine (--target-parallel tensor; torchrun x2 on CPU,
gloo): each rank's supervision equals the whole target's within fp32 rounding, for batches of different
shapes on each rank (the ranks exchange them and run each together). Training through it under
torchrun: tests/test_distributed.py. How auto decides: below."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spec_cli import distributed
from spec_cli.errors import ConfigError
from spec_cli.target import local
from tests.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_each_ranks_supervision_from_the_sharded_target_equals_the_whole_targets(tiny_llama_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "tests.target.tp_supervision", str(tiny_llama_dir), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["shape"] for r in ranks] == [[2, 24, 96], [1, 31, 96]]  # each rank kept its own batch
    for r in ranks:
        assert r["sharded"] and not r["replica_sharded"] and r["keys"]
        assert max(r["diffs"].values()) <= 1e-5, r["diffs"]
        assert r["diffs"]["target_ids"] == 0 and r["diffs"]["position_mask"] == 0


def test_auto_shards_only_a_target_too_big_for_one_gpu(monkeypatch, tmp_path):
    """The GPU path's decision, emulated: an 8B target (16 GB) on an 80 GB GPU stays whole on each rank,
    a 70B one (141 GB) is sharded; off GPUs, and in one process, the target is whole."""
    for key, value in {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(key, value)

    class H100:
        total_memory = 80 * 10**9

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H100)
    gpu = torch.device("cuda", 3)
    for size, sharded in ((16 * 10**9, False), (141 * 10**9, True)):
        monkeypatch.setattr(local.loading, "weights_bytes", lambda path, size=size: size)
        assert local.tensor_parallel("auto", "transformers", tmp_path, gpu)[0] is sharded
    assert local.tensor_parallel("auto", "transformers", tmp_path, torch.device("cpu"))[0] is False
    assert local.tensor_parallel("tensor", "transformers", tmp_path, torch.device("cpu"))[0] is True
    with pytest.raises(ConfigError, match="runs one engine per process"):
        local.tensor_parallel("tensor", "vllm", tmp_path, gpu)
    with pytest.raises(ConfigError) as refused:
        local.tensor_parallel("pipeline", "transformers", tmp_path, gpu)
    assert "unknown --target-parallel 'pipeline'" in refused.value.one_line()
    assert "use one of auto, replica, tensor" in refused.value.one_line()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert local.tensor_parallel("tensor", "transformers", tmp_path, gpu) == (False, "one process")
    assert distributed.world_size() == 1
