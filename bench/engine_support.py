"""Regenerate spec_cli/export/support.py's vLLM table from the installed vLLM.

    OMP_NUM_THREADS=1 python bench/engine_support.py > /tmp/vllm_table.py

For every architecture in vLLM's registry of text-generation and multimodal models, the model class is
loaded the way vLLM loads it (`ModelRegistry._try_load_model_cls`) and asked `supports_eagle3` (it
implements SupportsEagle3, the interface vLLM's EAGLE-3 proposer needs to capture aux hidden states).
Where a module does not import on this machine (the CPU build lacks torchvision for some vision
models), the class's bases are read from its source instead (SupportsEagle3 among them, directly or
through a base class in vLLM); both ways agree wherever both run.
"""

from __future__ import annotations

import ast
import os
import sys
import textwrap
from pathlib import Path


def _module_file(root: Path, module: str) -> tuple[str, Path]:
    full = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
    path = root.joinpath(*full.split(".")[1:])
    return full, (path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))


def from_source(root: Path, module: str, name: str, seen: set | None = None) -> bool | None:
    """Does class `name` of vLLM module `module` list SupportsEagle3 among its (transitive) bases?"""
    seen = set() if seen is None else seen
    if (module, name) in seen:
        return False
    seen.add((module, name))
    full, path = _module_file(root, module)
    if not path.is_file():
        return None
    tree = ast.parse(path.read_text())
    package = full if path.name == "__init__.py" else full.rsplit(".", 1)[0]
    imports = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                imports[alias.asname or alias.name] = (base, alias.name)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            for base in node.bases:
                base_name = getattr(base, "id", None) or getattr(base, "attr", None)
                if base_name == "SupportsEagle3":
                    return True
                where = imports.get(base_name)
                if (
                    where
                    and where[0].startswith("vllm.")
                    and from_source(root, where[0], where[1], seen)
                ):
                    return True
                if not where and base_name and from_source(root, full, base_name, seen):
                    return True
            return False
    where = imports.get(name)
    return (
        from_source(root, where[0], where[1], seen)
        if where and where[0].startswith("vllm.")
        else None
    )


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import logging

    logging.disable(logging.CRITICAL)
    import vllm
    from vllm.model_executor.models import registry
    from vllm.model_executor.models.interfaces import supports_eagle3

    from spec_cli.engine.vllm import version

    root = Path(vllm.__file__).parent
    served, not_served = [], []
    for table in ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS"):
        for arch, (module, name) in getattr(registry, table).items():
            cls = registry.ModelRegistry._try_load_model_cls(arch)
            ok = bool(supports_eagle3(cls)) if cls is not None else from_source(root, module, name)
            (served if ok else not_served).append(arch)

    def block(names: list[str]) -> str:
        body = ", ".join(f'"{n}"' for n in sorted(names))
        return "\n".join(textwrap.wrap(body, 104, initial_indent="    ", subsequent_indent="    "))

    sys.stdout.write(
        f'VLLM_VERSION = "{version()}"\n'
        f"VLLM_SERVED = frozenset({{\n{block(served)}\n}})\n"
        f"VLLM_NOT_SERVED = frozenset({{\n{block(not_served)}\n}})\n"
    )


if __name__ == "__main__":
    main()
