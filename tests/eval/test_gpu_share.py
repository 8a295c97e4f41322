"""vLLM engines held at once on one GPU share it: at vLLM's default gpu_memory_utilization (0.9)
each, the second engine finds less free memory than its share and refuses to start. `spec eval
--engine vllm` holds two (with the draft, and the target alone), `spec tune` the target alone and
its drafters. Emulated on the CPU: CUDA's presence patched, vLLM's Engine replaced by a recorder."""

import pytest
import torch

from spec_cli.engine import vllm


class Recorder:
    """Stands for vllm.Engine: keeps the keyword arguments it was started with."""

    started: list[dict] = []

    def __init__(self, *args, **kwargs):
        Recorder.started.append(kwargs)
        self.load_report = type("Report", (), {"problems": lambda self: []})()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def close(self):
        pass


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm, "Engine", Recorder)
    Recorder.started = []
    return Recorder.started


def test_the_default_share_is_split_between_the_engines_held_at_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm.shared_gpu(2) is None  # a CPU: the KV cache is VLLM_CPU_KVCACHE_SPACE
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vllm.shared_gpu(1) is None  # one engine: vLLM's own default
    assert vllm.shared_gpu(2) == pytest.approx(0.45)
    assert vllm.shared_gpu(3) == pytest.approx(0.3)
    assert 3 * vllm.shared_gpu(3) <= vllm.GPU_SHARE


def test_spec_evals_two_engines_each_take_half_the_default_or_the_share_given(gpu, tmp_path):
    from spec_cli.eval.session import VllmSession
    from spec_cli.eval.speculative import Settings

    VllmSession(tmp_path, torch.float32, 3, "eagle3", max_model_len=64).decoders(
        tmp_path, Settings()
    )
    assert [s["gpu_memory_utilization"] for s in gpu] == [0.45, 0.45]
    gpu.clear()
    VllmSession(tmp_path, torch.float32, 3, "eagle3", max_model_len=64, memory=0.1).decoders(
        tmp_path, Settings()
    )
    assert [s["gpu_memory_utilization"] for s in gpu] == [0.1, 0.1]


def test_a_tune_drafter_takes_the_share_it_is_given(gpu, tmp_path):
    from spec_cli.draft import algorithms
    from spec_cli.stages import tune

    config = {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3}
    eagle3 = algorithms.get("eagle3")
    tune._drafting_engine(tmp_path, config, eagle3, torch.float32, 64, 4, 4096, None, 0.45)
    tune._drafting_engine(tmp_path, config, eagle3, torch.float32, 64, 4, 4096, None)
    assert [s["gpu_memory_utilization"] for s in gpu] == [0.45, None]
