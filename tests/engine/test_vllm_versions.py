"""Which vLLM releases and model runners spec_cli runs with (spec_cli/engine/vllm_versions.py): the supported
range, the runner vLLM builds (checked against vLLM's own rule, VllmConfig.use_v2_model_runner, on the
installed vLLM), and the refusal, in one line with the way out, of what a release or runner does not serve
(P-EAGLE on 0.34, DSpark without the V2 runner). The installed version and the runner are monkeypatched:
no vLLM engine starts here."""

from __future__ import annotations

import pytest

from spec_cli.cli import main
from spec_cli.draft import algorithms
from spec_cli.engine import vllm
from spec_cli.engine import vllm_versions as versions
from spec_cli.errors import ConfigError

PEAGLE = algorithms.get("peagle").format("vllm")
DSPARK = algorithms.get("dspark").format("vllm")
EAGLE3 = algorithms.get("eagle3").format("vllm")
NO_TRITON = "its V2 model runner needs Triton with a backend for this machine"


@pytest.fixture
def installed(monkeypatch):
    """Make spec_cli read the installed vLLM as the given version, with the given runner and Triton."""
    monkeypatch.delenv(versions.FORCE, raising=False)

    def pretend(version: str, runner: str | None = None, triton: bool = True):
        monkeypatch.setattr(vllm, "available", lambda: True)
        monkeypatch.setattr(vllm, "version", lambda: version)
        monkeypatch.setattr(vllm, "v2_runner_missing", lambda: "" if triton else NO_TRITON)
        if runner is not None:
            monkeypatch.setattr(versions, "runner", lambda *args, **kwargs: runner)

    return pretend


@pytest.mark.parametrize(
    "version, says",
    [
        ("0.31.2", "vLLM 0.31.2 is older than the releases spec_cli runs with (0.32-0.34)"),
        (
            "0.35.0",
            "vLLM 0.35.0 is newer than the releases spec_cli was checked against (0.32-0.34)",
        ),
        ("0.35.0rc1", "vLLM 0.35.0rc1 is newer"),
        (
            "not-a-version",
            "the installed vLLM's version 'not-a-version' is not one spec_cli can read",
        ),
    ],
)
def test_a_release_outside_the_range_is_refused_with_the_range_to_install(version, says):
    why, hint = versions.version_refusal(version)
    assert says in why and "pip install 'vllm>=0.32,<0.35'" in hint


@pytest.mark.parametrize(
    "version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.34.0", "0.34.2.dev7+g1234abc"]
)
def test_the_releases_in_the_range_are_run(version):
    assert versions.version_refusal(version) == ("", "")


def test_the_extra_pins_the_range_the_code_supports():
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert (
        extras["vllm-gpu"] == [versions.REQUIREMENT] and versions.REQUIREMENT == "vllm>=0.32,<0.35"
    )


@pytest.mark.parametrize(
    "version, forced, triton, parallel, runner",
    [
        ("0.32.0", None, False, False, "v1"),  # the CPU build: no Triton
        ("0.32.0", None, True, False, "v2"),  # a CUDA GPU
        ("0.33.0", None, True, True, "v1"),  # P-EAGLE: V2 runs no parallel drafting of EAGLE drafts
        ("0.33.0", "0", True, False, "v1"),
        ("0.33.0", "1", False, True, "v2"),  # the switch wins (vLLM then fails: V2 without Triton)
        ("0.34.0", "0", False, True, "v2"),  # 0.34 has V2 alone
    ],
)
def test_the_runner_follows_vllms_rule(monkeypatch, version, forced, triton, parallel, runner):
    if forced is None:
        monkeypatch.delenv(versions.FORCE, raising=False)
    else:
        monkeypatch.setenv(versions.FORCE, forced)
    assert versions.runner(version, parallel, has_triton=lambda: triton) == runner


def test_a_switch_vllm_cannot_read_is_refused(monkeypatch):
    monkeypatch.setenv(versions.FORCE, "yes")
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER='yes' is not 0 or 1"):
        versions.runner("0.33.0")


@pytest.mark.parametrize(
    "fmt, version, runner, triton, says, hint",
    [
        (
            PEAGLE,
            "0.34.0",
            None,
            True,
            "vLLM 0.34.0 does not serve eagle3 drafts with parallel_drafting: 0.34 removed "
            "them along with its V1 model runner",
            "install vllm>=0.32,<0.34 (vLLM 0.32-0.33 serve them)",
        ),
        (
            PEAGLE,
            "0.33.0",
            "v2",
            True,
            "vLLM 0.33.0 builds its V2 model runner here (its choice where Triton runs), and "
            "serves eagle3 drafts with parallel_drafting only in V1",
            "set VLLM_USE_V2_MODEL_RUNNER=0",
        ),
        (
            DSPARK,
            "0.32.0",
            "v1",
            False,
            f"vLLM 0.32.0 runs dspark drafts only in its V2 model runner, and {NO_TRITON}",
            "",
        ),
        (
            DSPARK,
            "0.33.0",
            "v1",
            True,
            "vLLM 0.33.0 builds its V1 model runner here, and serves dspark drafts only in V2",
            "",
        ),
        (
            EAGLE3,
            "0.35.0",
            None,
            True,
            "vLLM 0.35.0 is newer than the releases spec_cli was checked against",
            "pip install 'vllm>=0.32,<0.35'",
        ),
    ],
)
def test_what_a_release_or_runner_does_not_serve_is_refused_with_the_way_out(
    installed, fmt, version, runner, triton, says, hint
):
    installed(version, runner, triton)
    why, way_out = vllm.refusal(fmt)
    assert says in why and hint in way_out
    assert vllm.cannot_run(fmt) == (f"{why}; {way_out}" if way_out else why)


@pytest.mark.parametrize(
    "fmt, version, runner",
    [
        (PEAGLE, "0.32.0", "v1"),
        (PEAGLE, "0.33.0", "v1"),
        (DSPARK, "0.33.0", "v2"),
        (DSPARK, "0.34.0", "v2"),
        (EAGLE3, "0.32.0", "v1"),
        (EAGLE3, "0.33.0", "v2"),
        (EAGLE3, "0.34.0", "v2"),
    ],
)
def test_what_a_release_and_its_runner_serve_runs(installed, fmt, version, runner):
    installed(version, runner)
    assert vllm.refusal(fmt) == ("", "") and vllm.cannot_run(fmt) == ""


def test_a_forced_runner_is_named_with_the_switch_to_unset(installed, monkeypatch):
    installed("0.33.0", triton=True)
    monkeypatch.setenv(versions.FORCE, "1")
    assert vllm.refusal(PEAGLE) == (
        "VLLM_USE_V2_MODEL_RUNNER=1 makes vLLM 0.33.0 build its V2 model runner, and it "
        "serves eagle3 drafts with parallel_drafting only in V1",
        "unset VLLM_USE_V2_MODEL_RUNNER",
    )


def test_only_a_release_that_serves_a_format_nowhere_is_unserved(installed):
    installed("0.34.0", "v2")
    assert "0.34 removed them" in vllm.unserved(PEAGLE) and vllm.unserved(EAGLE3) == ""
    installed("0.32.0", "v1", triton=False)
    assert vllm.unserved(DSPARK) == "" and vllm.cannot_run(
        DSPARK
    )  # a GPU with 0.32 serves it; this machine not


@pytest.mark.parametrize(
    "argv",
    [
        [
            "regenerate",
            "-t",
            "{target}",
            "-d",
            "{target}/none.jsonl",
            "--engine",
            "vllm",
            "-o",
            "{out}/r.jsonl",
        ],
        [
            "precompute",
            "-t",
            "{target}",
            "-d",
            "{target}/none.jsonl",
            "-v",
            "{target}/vm.safetensors",
            "--target-engine",
            "vllm",
            "-o",
            "{out}/cache",
        ],
    ],
)
def test_commands_refuse_a_release_outside_the_range_in_one_line(
    installed, tiny_llama_dir, tmp_path, capsys, argv
):
    installed("0.35.0")
    code = main([a.format(target=tiny_llama_dir, out=tmp_path) for a in argv])
    err = " ".join(capsys.readouterr().err.split())
    assert (
        code == 1
        and "vLLM 0.35.0 is newer than the releases spec_cli was checked against (0.32-0.34)" in err
    )
    assert "pip install 'vllm>=0.32,<0.35'" in err and "Traceback" not in err


def test_the_serving_line_of_each_algorithm_comes_from_its_formats():
    lines = {name: versions.serving_line(a) for name, a in algorithms.ALGORITHMS.items()}
    assert lines["peagle"] == (
        "P-EAGLE drafts are served by vLLM 0.32-0.33 (its V1 model runner); not by vLLM 0.34 "
        "(it removed its V1 model runner, and them with it) nor by SGLang (spec_cli writes no "
        "SGLang format for them)"
    )
    assert lines["eagle3"] == "EAGLE-3 drafts are served by vLLM 0.32-0.34 and SGLang"
    assert lines["dspark"].startswith(
        "DSpark drafts are served by vLLM 0.32-0.34 in its V2 model runner"
    )
    assert lines["msd"] == algorithms.get("msd").not_served


def test_the_runner_rule_is_vllms_own_on_the_installed_vllm(monkeypatch):
    """versions.runner against VllmConfig.use_v2_model_runner of the installed vLLM (0.32, 0.33), run on a
    stand-in config that holds what spec_cli's engines set (no engine starts)."""
    pytest.importorskip("vllm")
    from types import MethodType, SimpleNamespace

    import vllm.config.vllm as config
    from vllm import envs

    envs.disable_envs_cache()  # an engine started earlier in this process cached the environment
    installed_version = vllm.version()
    if versions.release(installed_version) >= versions.NO_V1:
        pytest.skip(f"vLLM {installed_version} has one runner")
    rule = config.VllmConfig.use_v2_model_runner

    def vllms_own(method: str | None, parallel: bool) -> str:
        spec = (
            None
            if method is None
            else SimpleNamespace(
                method=method, parallel_drafting=parallel, use_heterogeneous_vocab=False
            )
        )
        stand_in = SimpleNamespace(
            attention_config=SimpleNamespace(hisparse_config=None),
            watermark_config=None,
            speculative_config=spec,
            parallel_config=SimpleNamespace(
                distributed_executor_backend="uni", pipeline_parallel_size=1, use_ubatching=False
            ),
        )
        stand_in._get_v2_model_runner_unsupported_features = MethodType(
            config.VllmConfig._get_v2_model_runner_unsupported_features, stand_in
        )
        return "v2" if rule.fget(stand_in) else "v1"

    for forced in (None, "0", "1"):
        for triton in (False, True):
            if forced is None:
                monkeypatch.delenv(versions.FORCE, raising=False)
            else:
                monkeypatch.setenv(versions.FORCE, forced)
            monkeypatch.setattr(config, "HAS_TRITON", triton)
            for method, parallel in (
                (None, False),
                ("eagle3", False),
                ("eagle3", True),
                ("eagle", False),
                ("dflash", False),
                ("dspark", False),
            ):
                ours = versions.runner(
                    installed_version, parallel and method == "eagle3", has_triton=lambda: triton
                )
                assert ours == vllms_own(method, parallel), (forced, triton, method, parallel)


def test_the_installed_vllm_defines_what_the_bench_lists_spec_cli_reads():
    """bench/vllm_versions.py's USES (what spec_cli reads of vLLM's engine and runners, checked there in each
    release's sources) found in the installed vLLM's sources; V1's rows only where the release has V1."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or vllm.version() is None:
        pytest.skip("vLLM is not installed")
    loader = importlib.util.spec_from_file_location(
        "vllm_versions_bench", Path(__file__).parents[2] / "bench" / "vllm_versions.py"
    )
    bench = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(bench)
    root = Path(spec.origin).parent
    has_v1 = versions.release(vllm.version()) < versions.NO_V1
    missing = [
        f"{what} ({path})"
        for what, runner, path, cls, name in bench.USES
        if (runner != "V1" or has_v1) and bench.where(root, path, cls, name) == "—"
    ]
    assert missing == []
    assert (
        bench.runner_rule(root)["peagle_to_v1"]
        if has_v1
        else not bench.runner_rule(root)["v1_runner"]
    )
