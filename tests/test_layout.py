"""The code's shape, read from its source: no import circles in optim/ or harness/, no private name
used across files, optim never imports harness, and no file over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("optim", "harness")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node, except what sits under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(target module, imported name or None, alias) for each import of an optim/harness module."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in modules:
                    yield full, None, a.asname or a.name
                else:
                    yield base, a.name, a.asname or a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    yield a.name, None, a.asname or a.name


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_and_no_private_name_across_files():
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private, optim_to_harness = [], []
    for name, path in modules.items():
        module_aliases = {}
        for target, imported, alias in _imports(name, path, modules):
            if target not in modules or target == name:
                continue
            if name.startswith(target + "."):
                continue  # a module reading its own package's __init__ is how packages load
            edges[name].add(target)
            if name.split(".")[0] == "optim" and target.split(".")[0] == "harness":
                optim_to_harness.append(f"{name} imports {target}")
            if imported is None:
                module_aliases[alias] = target
            elif imported.startswith("_") and not imported.startswith("__"):
                private.append(f"{path.relative_to(ROOT)}: {imported} from {target}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in module_aliases and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                private.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not optim_to_harness, optim_to_harness
    assert not private, "private names used across files (make them public where they belong):\n" + "\n".join(private)
    assert not _cycles(edges), _cycles(edges)


def test_the_checks_find_what_they_look_for():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nimport y\n")
    names = [n.names[0].name for n in _runtime_nodes(tree) if isinstance(n, ast.Import)]
    assert names == ["y"]


def test_no_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by job: {long}"
