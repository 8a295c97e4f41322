"""Shared fixtures: tiny tokenizers with real chat templates, tiny random models, an isolated SPEC_HOME."""

from __future__ import annotations

import json
import os
import random
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import tiny

# The user's SPEC_HOME (where `spec assets` installed the built-in assets), read before any test sets its own.
USER_HOME = Path(os.environ.get("SPEC_HOME") or Path.home() / ".cache" / "spec_cli").expanduser()


@pytest.fixture(scope="session", autouse=True)
def _session_env(tmp_path_factory):
    """For the whole run, module fixtures included: a SPEC_HOME of the tests' own (never the user's), no
    model hub, fp32 training steps, and exports skip vLLM's engine check (auto when vLLM is installed: seconds per export,
    and the tiny targets' head_dim 8 is not one vLLM's CPU kernels run); the engine tests turn it back on."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SPEC_HOME", str(tmp_path_factory.mktemp("session_home")))
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("SPEC_ENGINE_CHECK", "none")
    # spec train's --precision auto is bf16 on CPUs that run it natively: pin fp32 so that a test's
    # numbers are the same on every CPU class (tests of bf16 ask for it)
    mp.setenv("SPEC_TRAIN_PRECISION", "fp32")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: two workers share the cores
        # one intra-op thread each, and in the processes they start: OpenMP threads spin-wait for a core
        # the other worker holds (spec_cli/threads.py: 113.6 s on 2 threads beside a busy neighbour, 13.3 s on 1)
        import torch

        mp.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch, request):
    """Every test gets its own SPEC_HOME (the tokenisation cache lives there)."""
    monkeypatch.setenv("SPEC_HOME", str(tmp_path_factory.mktemp("spec_home")))
    if request.node.get_closest_marker("engine") is not None:
        monkeypatch.setenv("SPEC_ENGINE_CHECK", "auto")


SPEC_CLI = str(Path(__file__).resolve().parent.parent / "spec_cli")


@pytest.fixture(autouse=True)
def _no_deprecated_calls_of_ours(monkeypatch):
    """The test fails when spec_cli's own code makes a call that warns FutureWarning or DeprecationWarning
    (a library's deprecated argument, say): whatever frame the library attributes the warning to, a
    spec_cli frame on the stack at that moment means our call. Users see these in the middle of a
    command's output; the next release of the library breaks the call."""
    import sys
    import warnings

    ours: list[str] = []
    real_warn, real_explicit = warnings.warn, warnings.warn_explicit

    def package(frame) -> str:
        return frame.f_globals.get("__name__", "").split(".")[0]

    def check(message, category) -> None:
        """Ours when the first frame outside the warning library's own code (and torch's module-call
        machinery, through which a model's forward is called) is spec_cli's: the call that made the
        library warn. A library warning about its own internals, called from us, is not ours."""
        kind = type(message) if isinstance(message, Warning) else (category or UserWarning)
        if not issubclass(kind, (FutureWarning, DeprecationWarning)):
            return
        frame = sys._getframe(2)  # the frame that called warnings.warn
        library = package(frame)
        while frame is not None and package(frame) in (library, "torch", "functools", "contextlib"):
            frame = frame.f_back
        if (
            frame is not None
            and frame.f_code.co_filename.startswith(SPEC_CLI)
            and library != "spec_cli"
        ):
            ours.append(
                f"{kind.__name__}: {message} (our call at {frame.f_code.co_filename}:{frame.f_lineno})"
            )
        elif library == "spec_cli":  # spec_cli warning deprecation itself
            ours.append(f"{kind.__name__}: {message} (raised by spec_cli)")

    def warn(message, category=None, stacklevel=1, source=None, **kwargs):
        check(message, category)
        return real_warn(message, category, stacklevel + 1, source, **kwargs)

    def warn_explicit(message, category, *args, **kwargs):
        check(message, category)
        return real_explicit(message, category, *args, **kwargs)

    monkeypatch.setattr(warnings, "warn", warn)
    monkeypatch.setattr(warnings, "warn_explicit", warn_explicit)
    yield
    if ours:
        pytest.fail(
            "spec_cli's own calls warned:\n" + "\n".join(dict.fromkeys(ours)), pytrace=False
        )


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
    return {
        family: tiny.save_tiny_target(root / family, family, with_model=False)
        for family in tiny.TEMPLATES
    }


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama target (tokenizer + weights) saved as a transformers folder."""
    return tiny.save_tiny_target(
        tmp_path_factory.mktemp("llama") / "tiny-llama", "llama3", with_model=True
    )


@pytest.fixture(scope="session")
def train_setup(tmp_path_factory, tiny_llama_dir) -> dict:
    """A peaked tiny Llama target (tiny.peaked_copy), 48 chats, a vocab map (96) and a feature cache, all
    made through the CLI: the inputs of spec train's tests, torchrun's and the kill tests."""
    root = tmp_path_factory.mktemp("train")
    target = tiny.peaked_copy(tiny_llama_dir, root / "peaky-llama")
    rng = random.Random(11)
    data = write_jsonl(root / "chat.jsonl", [tiny.random_sharegpt(rng) for _ in range(48)])
    from tests.draft.runs import vocab_and_cache

    vm, cache = vocab_and_cache(root, target, data, 96, "--batch-tokens", "512")
    return {"root": root, "data": data, "vm": vm, "cache": cache, "target": target}


@pytest.fixture(scope="session")
def eagle_pipeline(tmp_path_factory, tiny_llama_dir) -> dict:
    """EAGLE-1/2 on the tiny Llama: vocab map, cache and a 4-step run (tests/draft/runs.py)."""
    from tests.draft.runs import pipeline

    return pipeline(tmp_path_factory.mktemp("eagle"), tiny_llama_dir, "eagle")


@pytest.fixture(scope="session")
def peagle_pipeline(tmp_path_factory, tiny_llama_dir) -> dict:
    """P-EAGLE on the tiny Llama: vocab map, cache and a 4-step run of two segments (tests/draft/runs.py)."""
    from tests.draft.runs import pipeline

    return pipeline(tmp_path_factory.mktemp("peagle"), tiny_llama_dir, "peagle")


@pytest.fixture(scope="session")
def dflash_pipeline(tmp_path_factory, tiny_llama_dir) -> dict:
    """DFlash on the tiny Llama: vocab map, cache and a 4-step run with blocks of 4 (tests/draft/runs.py)."""
    from tests.draft.runs import pipeline

    return pipeline(tmp_path_factory.mktemp("dflash"), tiny_llama_dir, "dflash")


def default_sigint() -> None:
    """Popen(preexec_fn=...) for a child a test sends SIGINT or SIGTERM: a shell starts background jobs
    with SIGINT ignored, the child inherits that, and Python then installs no KeyboardInterrupt handler
    (and spec_cli leaves an ignored signal ignored)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def signalled_child(cmd: list[str], **popen):
    """A `spec` process a test sends signals to: started with the signals' default dispositions however
    the suite was started, and killed when the test ends, failed or not (a test that fails never leaves a
    long run behind, taking a core from the tests after it)."""
    proc = subprocess.Popen(cmd, preexec_fn=default_sigint, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def wait_for(path: Path, proc: subprocess.Popen, what: str, seconds: float = 60) -> None:
    """Until `proc` has written `path` (a test then signals it mid-run); fails if it ends first or takes
    longer than `seconds`."""
    import time

    deadline = time.time() + seconds
    while not path.exists():
        assert time.time() < deadline and proc.poll() is None, f"{what} did not get going"
        time.sleep(0.05)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def chat_records() -> list[dict]:
    rng = random.Random(0)
    return [tiny.random_sharegpt(rng) for _ in range(40)]


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_restored():
    """A vLLM engine built in this process replaces torch.set_num_threads with a no-op and leaves its own
    thread count; both are put back after each module, so that what runs next runs as it would alone."""
    import torch

    setter, threads = torch.set_num_threads, torch.get_num_threads()
    yield
    torch.set_num_threads = setter
    torch.set_num_threads(threads)


# What the newest transformers and datasets can change: data into token ids and loss masks, loading and
# running targets, decoding, the stages around them. .ci/run runs these (but for the engine tests) in the
# environment `pip install -e .` makes (the newest versions the project allows), the rest where the
# README's main command installs (the vllm extra pins transformers): each test once, in the environment
# its behaviour depends on (marker `latest`, given at collection).
LATEST = (
    "tests/data/",
    "tests/targets/",
    "tests/eval/",
    "tests/stages/test_regenerate.py",
    "tests/stages/test_precompute.py",
    "tests/stages/test_demo.py",
    "tests/stages/test_chat_template.py",
    "tests/test_real_smollm2.py",
    "tests/e2e/",
)

# Modules that time the processes they start (kills at fractions of a measured run) or start many at once:
# under xdist they run one after the other on one worker, never beside each other.
TOGETHER = {"tests/stages/test_kills.py": "processes", "tests/test_distributed.py": "processes"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Modules with engine tests first, then those with slow ones, then the rest (each in file order), so
    that under `pytest -n 2 --dist loadgroup --no-loadscope-reorder` the longest start first and no long
    one is left running alone at the end; each module is one xdist group (its module fixtures are built
    once), TOGETHER's share one."""

    def rank(item) -> int:
        markers = {m.name for i in by_module[item.module] for m in i.iter_markers()}
        return 0 if "engine" in markers else 1 if "slow" in markers else 2

    by_module: dict = {}
    for item in items:
        by_module.setdefault(item.module, []).append(item)
        if item.nodeid.startswith(LATEST) and item.get_closest_marker("engine") is None:
            item.add_marker(pytest.mark.latest)
    items.sort(key=rank)
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            path = item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(TOGETHER.get(path, path)))


def _stats(paths) -> dict[str, tuple[int, int]]:
    """Every file under `paths` -> (size, mtime)."""
    files = [
        f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()
    ]
    return {str(f): (f.stat().st_size, f.stat().st_mtime_ns) for f in files}


@pytest.fixture(scope="session")
def real_assets() -> dict[str, Path]:
    """The built-in SmolLM2 / ShareGPT / MT-bench that `spec assets` (the install step, before the tests)
    put in the user's SPEC_HOME, by path: resolved once, without writing, and only read from then on (the
    run fails if a test changed them). Tests pass these paths; what they write goes to their own home.
    {"target", "sharegpt", "mt-bench"} -> path."""
    from spec_cli import assets
    from spec_cli.errors import AssetError

    try:
        found = assets.installed(USER_HOME)
    except AssetError as exc:
        pytest.fail(
            f"the real-model tests read the installed assets: {exc}; run `spec assets` first"
        )
    before = _stats(found.values())
    yield {"target": found["smollm2"], "sharegpt": found["sharegpt"], "mt-bench": found["mt-bench"]}
    assert _stats(found.values()) == before, "a test changed the installed assets"


@pytest.fixture
def real_home(real_assets) -> Path:
    """This test's own SPEC_HOME with the installed assets linked in (read only), so the built-in names
    (`-t smollm2`, `mt-bench`) resolve to them without installing or writing anything."""
    from spec_cli import assets
    from spec_cli.paths import spec_home

    home = spec_home()
    assert home.resolve() != USER_HOME.resolve()
    (home / "assets").mkdir(parents=True, exist_ok=True)
    for name, key in (
        (assets.TARGETS["smollm2"], "target"),
        (assets.DATASETS["sharegpt"], "sharegpt"),
        (assets.DATASETS["mt-bench"], "mt-bench"),
    ):
        (home / "assets" / name).symlink_to(real_assets[key])
    return home
