"""The house rules that a reader of the code relies on, checked: no import loops between
kvpool's modules (lazy and type-checking imports count: a loop is a loop to the reader), and
no module over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src"
MAX_LINES = 500


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SOURCE / "kvpool").rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kvpool modules `name` imports anywhere in its file (a package's submodule imported
    by name counts as that submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {module for module in found if module in known and module != name}


def test_no_module_imports_itself_through_another():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    loops = []
    for name, targets in graph.items():
        # Every module reachable from a target that leads back to `name`.
        for target in targets:
            seen, stack = {target}, [target]
            while stack:
                for nxt in graph[stack.pop()]:
                    if nxt == name:
                        loops.append((name, target))
                        stack = []
                        break
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
    assert not loops, f"import loops (module, the import that leads back to it): {loops}"


def test_no_module_is_over_500_lines():
    long = {
        name: count
        for name, path in modules().items()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
