"""Shared fixtures: tiny tokenizers with real chat templates, tiny random models, an isolated SPEC_HOME."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests import tiny


@pytest.fixture(scope="session", autouse=True)
def _no_engine_check():
    """Exports skip vLLM's engine check (auto when vLLM is installed: seconds per export, and the tiny
    targets' head_dim 8 is not one vLLM's CPU kernels run), module fixtures included; the engine tests
    turn it back on."""
    previous = os.environ.get("SPEC_ENGINE_CHECK")
    os.environ["SPEC_ENGINE_CHECK"] = "none"
    yield
    if previous is None:
        os.environ.pop("SPEC_ENGINE_CHECK", None)
    else:
        os.environ["SPEC_ENGINE_CHECK"] = previous


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch, request):
    """Every test gets its own SPEC_HOME (the tokenisation cache lives there)."""
    monkeypatch.setenv("SPEC_HOME", str(tmp_path_factory.mktemp("spec_home")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if request.node.get_closest_marker("engine") is not None:
        monkeypatch.setenv("SPEC_ENGINE_CHECK", "auto")


@pytest.fixture(autouse=True)
def _loud_console():
    """`-q` sets a process-wide switch (spec_cli.console); a test that ran the CLI quietly must not
    silence the next test's output."""
    from spec_cli.console import set_quiet

    set_quiet(False)
    yield
    set_quiet(False)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one intra-op thread is faster than two (and immune to a busy machine).
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> a saved tokenizer folder (+ tiny model config) for each chat-template family."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: tiny.save_tiny_target(root / family, family, with_model=False)
            for family in tiny.TEMPLATES}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama target (tokenizer + weights) saved as a transformers folder."""
    return tiny.save_tiny_target(tmp_path_factory.mktemp("llama") / "tiny-llama", "llama3",
                                 with_model=True)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def chat_records() -> list[dict]:
    rng = random.Random(0)
    return [tiny.random_sharegpt(rng) for _ in range(40)]


def pytest_collection_modifyitems(config, items):
    """Engine tests last: vLLM, once loaded in this process, keeps its own torch thread settings (it
    replaces torch.set_num_threads), which would change how every later test runs."""
    items.sort(key=lambda item: item.get_closest_marker("engine") is not None)


REAL_HOME = Path(os.environ.get("SPEC_HOME") or Path.home() / ".cache" / "spec_cli")


@pytest.fixture(scope="session")
def real_assets() -> dict[str, Path]:
    """The built-in SmolLM2 / ShareGPT / MT-bench, installed by `spec assets` into the user's SPEC_HOME
    (the install step; read only from then on). Tests pass these paths explicitly and write everything
    else (tokenisation caches, conversions, runs) into their own temporary SPEC_HOME."""
    from spec_cli.cli import main

    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(REAL_HOME))
    try:
        assert main(["assets", "-q"]) == 0
    finally:
        mp.undo()
    folder = REAL_HOME / "assets"
    return {"home": REAL_HOME, "target": folder / "SmolLM2-135M-Instruct", "sharegpt": folder / "sharegpt.jsonl",
            "mt-bench": folder / "mt_bench.jsonl"}


def home_snapshot() -> dict[str, int]:
    """Every file under the user's SPEC_HOME with its mtime (the real-model tests must leave it as is)."""
    if not REAL_HOME.is_dir():
        return {}
    return {str(p.relative_to(REAL_HOME)): p.stat().st_mtime_ns for p in REAL_HOME.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def untouched_real_home(real_assets):
    """Module fixture: fails the module's last test if anything under the user's SPEC_HOME changed."""
    before = home_snapshot()
    yield
    after = home_snapshot()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"tests wrote into the user's SPEC_HOME: {changed[:5]}"
