"""Dependencies point one way: no two packages of spec_cli import each other, directly or around a
loop, counting every `import` / `from` statement, lazy imports inside functions included.

A unit is a package (spec_cli.target) or a top-level module (spec_cli.cli, spec_cli.batch); imports
within one unit are free. The graph is read from the source with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "spec_cli"

# Loops older than this test, each named by the one import that would break it; whoever breaks one
# deletes its line, and test_each_known_loop_is_still_there says when. None is left.
KNOWN_LOOPS: dict[tuple[str, str], str] = {}


def _is_module(root: Path, name: str) -> bool:
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported(root: Path, path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every spec_cli module `path` imports; relative imports resolved."""
    here = path.relative_to(root.parent).with_suffix("").parts
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ((base,) if base else ()))
            for alias in node.names:  # `from pkg import module` imports pkg.module; else pkg itself
                name = f"{base}.{alias.name}"
                out.append((node.lineno, name if _is_module(root, name) else base))
    return [(line, name) for line, name in out if name.split(".")[0] == root.name]


def unit(name: str) -> str:
    return ".".join(name.split(".")[:2])


def package_graph(root: Path = ROOT) -> dict[tuple[str, str], str]:
    """{(importer unit, imported unit): where, the first such import} over every file under root."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        importer = unit(".".join(path.relative_to(root.parent).with_suffix("").parts))
        for line, name in _imported(root, path, ast.parse(path.read_text(encoding="utf-8"))):
            if unit(name) != importer:
                edges.setdefault((importer, unit(name)), f"{path.relative_to(root.parent)}:{line} imports {name}")
    return edges


def find_loop(edges, start: str) -> list[str] | None:
    """The shortest path of units from `start` back to itself, or None."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for a, b in edges:
            if a == path[-1] and b == start:
                return path + [start]
            if a == path[-1] and b not in seen:
                seen.add(b)
                paths.append(path + [b])
    return None


def describe(edges, loop: list[str]) -> str:
    return "\n".join(f"  {a} -> {b}: {edges[(a, b)]}" for a, b in zip(loop, loop[1:]))


def test_no_two_packages_import_each_other():
    edges = {e: where for e, where in package_graph().items() if e not in KNOWN_LOOPS}
    for importer in sorted({a for a, _ in edges}):
        loop = find_loop(edges, importer)
        assert loop is None, f"import loop {' -> '.join(loop)}:\n{describe(edges, loop)}"


def test_each_known_loop_is_still_there():
    edges = package_graph()
    for (a, b), why in KNOWN_LOOPS.items():
        assert (a, b) in edges and find_loop(edges, a), \
            f"{a} -> {b} ({why}) no longer closes a loop: delete it from KNOWN_LOOPS"


def test_lazy_and_relative_imports_count(tmp_path):
    root = tmp_path / "spec_cli"
    for folder, text in (("a", "def f():\n    from spec_cli.b import y\n"), ("b", "from ..a import x\n")):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
        (root / folder / ("x.py" if folder == "a" else "y.py")).write_text(text)
    edges = package_graph(root)
    assert find_loop(edges, "spec_cli.a") == ["spec_cli.a", "spec_cli.b", "spec_cli.a"]
    assert edges[("spec_cli.a", "spec_cli.b")] == "spec_cli/a/x.py:2 imports spec_cli.b.y"
