"""Dependencies point one way: no two packages of spec_cli import each other, and no two modules
either, directly or around a loop, counting every `import` / `from` statement, lazy imports inside
functions included.

Two granularities, one test each:
- packages: a unit is a package (spec_cli.targets) or a top-level module (spec_cli.cli,
  spec_cli.batch); imports within one unit are free here;
- modules: a unit is one .py file (spec_cli.draft.config), a package's __init__.py being the
  package's unit (spec_cli.draft.eagle3); `from pkg import name` counts as importing pkg.name when
  that is a module, else pkg's __init__.
The graph is read from the source with `ast`, nothing is imported.
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
    package = path.relative_to(root.parent).parts[
        :-1
    ]  # what `from .` means in this file, __init__ too
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package[: len(package) - node.level + 1] + ((base,) if base else ())
                )
            for alias in node.names:  # `from pkg import module` imports pkg.module; else pkg itself
                name = f"{base}.{alias.name}"
                out.append((node.lineno, name if _is_module(root, name) else base))
    return [(line, name) for line, name in out if name.split(".")[0] == root.name]


def unit(name: str) -> str:
    return ".".join(name.split(".")[:2])


def module_name(root: Path, path: Path) -> str:
    """spec_cli/draft/config.py -> spec_cli.draft.config; spec_cli/draft/__init__.py -> spec_cli.draft."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, unit=unit) -> dict[tuple[str, str], str]:
    """{(importer unit, imported unit): where, the first such import} over every file under root;
    `unit` maps a module name to its unit (by default its package)."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        importer = unit(module_name(root, path))
        for line, name in _imported(root, path, ast.parse(path.read_text(encoding="utf-8"))):
            if unit(name) != importer:
                edges.setdefault(
                    (importer, unit(name)), f"{path.relative_to(root.parent)}:{line} imports {name}"
                )
    return edges


def package_graph(root: Path = ROOT) -> dict[tuple[str, str], str]:
    return import_graph(root, unit)


def module_graph(root: Path = ROOT) -> dict[tuple[str, str], str]:
    return import_graph(root, lambda name: name)


def find_loop(edges, start: str) -> list[str] | None:
    """The shortest path of units from `start` back to itself, or None."""
    after: dict[str, list[str]] = {}
    for a, b in edges:
        after.setdefault(a, []).append(b)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for b in after.get(path[-1], ()):
            if b == start:
                return path + [start]
            if b not in seen:
                seen.add(b)
                paths.append(path + [b])
    return None


def find_loops(edges) -> list[list[str]]:
    """One loop per group of units that reach each other (a strongly connected component): the
    shortest through any of its units, started at its first unit by name."""
    loops: dict[frozenset[str], list[str]] = {}
    for start in sorted({a for a, _ in edges}):
        loop = find_loop(edges, start)
        if loop is None:
            continue
        group = frozenset(u for u in _reachable(edges, start) if start in _reachable(edges, u))
        if group not in loops or len(loop) < len(loops[group]):
            loops[group] = loop
    return [loops[group] for group in sorted(loops, key=sorted)]


def _reachable(edges, start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        a = todo.pop()
        for b in [b for x, b in edges if x == a and b not in seen]:
            seen.add(b)
            todo.append(b)
    return seen


def describe(edges, loop: list[str]) -> str:
    return "\n".join(f"  {a} -> {b}: {edges[(a, b)]}" for a, b in zip(loop, loop[1:]))


def report(edges, loops: list[list[str]]) -> str:
    out = []
    for loop in loops:
        group = sorted(u for u in _reachable(edges, loop[0]) if loop[0] in _reachable(edges, u))
        out.append(
            f"import loop {' -> '.join(loop)}:\n{describe(edges, loop)}"
            + (
                f"\n  (the shortest; {len(group)} units reach each other: {', '.join(group)})"
                if len(group) > len(loop) - 1
                else ""
            )
        )
    return "\n".join(out)


def test_no_two_packages_import_each_other():
    edges = {e: where for e, where in package_graph().items() if e not in KNOWN_LOOPS}
    loops = find_loops(edges)
    assert not loops, report(edges, loops)


def test_no_two_modules_import_each_other():
    """The same at module granularity: within a package too, no module needs one that needs it
    (at import time such a loop works only in one import order; a lazy import hides it until then)."""
    edges = module_graph()
    loops = find_loops(edges)
    assert not loops, f"{len(loops)} module import loop(s):\n" + report(edges, loops)


def test_each_known_loop_is_still_there():
    edges = package_graph()
    for (a, b), why in KNOWN_LOOPS.items():
        assert (a, b) in edges and find_loop(edges, a), (
            f"{a} -> {b} ({why}) no longer closes a loop: delete it from KNOWN_LOOPS"
        )


def test_lazy_and_relative_imports_count(tmp_path):
    root = tmp_path / "spec_cli"
    for folder, text in (
        ("a", "def f():\n    from spec_cli.b import y\n"),
        ("b", "from ..a import x\n"),
    ):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
        (root / folder / ("x.py" if folder == "a" else "y.py")).write_text(text)
    edges = package_graph(root)
    assert find_loop(edges, "spec_cli.a") == ["spec_cli.a", "spec_cli.b", "spec_cli.a"]
    assert edges[("spec_cli.a", "spec_cli.b")] == "spec_cli/a/x.py:2 imports spec_cli.b.y"


def test_module_loops_are_named_by_their_imports(tmp_path):
    root = tmp_path / "spec_cli"
    (root / "a" / "b").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a/__init__.py": "from spec_cli.a import config\n",
        "a/config.py": "def f():\n    from spec_cli.a.registry import get\n",
        "a/registry.py": "from spec_cli.a.b import B\n",
        "a/b/__init__.py": "from .model import B\n",
        "a/b/model.py": "from spec_cli.a import config\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    edges = module_graph(root)
    assert find_loops(package_graph(root)) == []  # all inside one package
    assert find_loops(edges) == [
        [
            "spec_cli.a.b",
            "spec_cli.a.b.model",
            "spec_cli.a.config",
            "spec_cli.a.registry",
            "spec_cli.a.b",
        ]
    ]
    assert (
        edges[("spec_cli.a.config", "spec_cli.a.registry")]
        == "spec_cli/a/config.py:2 imports spec_cli.a.registry"
    )
    assert (
        edges[("spec_cli.a.b", "spec_cli.a.b.model")]
        == "spec_cli/a/b/__init__.py:1 imports spec_cli.a.b.model"
    )
