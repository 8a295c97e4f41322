"""--target-parallel: how `auto` decides, and what is refused. The sharded target itself runs under torchrun
in tests/test_distributed.py's launch (tests/targets/tp_supervision.py: each rank's supervision equals the
whole target's; training through it equals training from whole copies)."""

import pytest
import torch

from spec_cli import distributed
from spec_cli.errors import ConfigError
from spec_cli.targets import local


def test_auto_shards_only_a_target_too_big_for_one_gpu(monkeypatch, tmp_path):
    """The GPU path's decision, emulated: an 8B target (16 GB) on an 80 GB GPU stays whole on each rank,
    a 70B one (141 GB) is sharded; off GPUs, and in one process, the target is whole."""
    for key, value in {
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "8",
        "RANK": "3",
        "LOCAL_RANK": "3",
    }.items():
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


def test_vllm_tensor_parallel_is_refused_for_transformers(tmp_path):
    """--target-tensor-parallel is vLLM's own (its worker processes); the transformers engine says
    what to use instead before loading anything."""
    with pytest.raises(ConfigError) as refused:
        local.open_backend("transformers", tmp_path, None, "cpu", "fp32", vllm_tensor_parallel=2)
    assert "--target-tensor-parallel is vLLM's" in refused.value.one_line()
    assert "--target-parallel tensor" in refused.value.one_line()
