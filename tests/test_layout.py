"""The code's layout rules, checked on the source (docs/ARCHITECTURE.md states them):

- no import loops between modules, counting every import (function-level and `TYPE_CHECKING`
  ones included: a type that must point back up is moved down instead);
- no module reaches into another module's private names (`from m import _x`, `m._x`);
- the server and the benchmarks use only the `engine` package's public names;
- no source file over 450 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import engine

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "bench", "tests")
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of our packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import statement in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found += [(base, a.name, node.lineno) for a in node.names]
    return found


def _edges() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (`from pkg import mod` counts as importing pkg.mod)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for module, item, _ in _imports(name, path):
            target = f"{module}.{item}" if item is not None and f"{module}.{item}" in MODULES else module
            if target in MODULES and target != name:
                graph[name].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_loops():
    cycle = _find_cycle(_edges())
    assert cycle is None, "import loop: " + " -> ".join(cycle)


def test_the_loop_check_sees_a_loop():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_names_imported_across_modules():
    bad = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        module_aliases = set()
        for module, item, line in _imports(name, path):
            if item is not None and _private(item) and module.split(".")[0] in PACKAGES:
                bad.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {item}")
        for node in ast.walk(tree):  # `import engine.x as m` / `from engine import x`, then m._y
            if isinstance(node, ast.Import):
                module_aliases |= {a.asname or a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                module_aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                root = node.value
                if isinstance(root, ast.Name) and root.id in module_aliases:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {root.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", ["server", "bench"])
def test_server_and_benchmarks_use_only_public_engine_names(package):
    public = set(engine.__all__)
    bad = []
    for name, path in MODULES.items():
        if name.split(".")[0] != package:
            continue
        for module, item, line in _imports(name, path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if module == "engine" and item is not None and item not in public:
                bad.append(f"{where}: engine.{item} is not public")
            elif module.startswith("engine."):
                bad.append(f"{where}: imports {module} (use `from engine import ...`)")
    assert not bad, "\n".join(bad)


def test_no_file_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
