"""Every module of the package imports only downward: no module imports one that imports it back,
directly or through others. Imports inside functions count too (a lazy import is still a
dependency), except those under `if TYPE_CHECKING:`."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, from pyproject's package-dir (`pallasite.model` = `model/`)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setup["package-dir"]
    modules = {}
    for package in setup["packages"]:
        parent = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        folder = ROOT / dirs[parent] / Path(*package[len(parent):].split(".")[1:])
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported(name: str, path: Path, modules) -> set[str]:
    """The package's modules that `name` imports; `from X import Y` counts X.Y when Y is one."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found, todo = set(), [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        if _type_checking(node):
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a non-module: nearest one
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_package():
    modules = package_modules()
    assert {"pallasite.cli", "pallasite.serving.engine", "pallasite.tools.plan.cli",
            "pallasite.sharding.rules", "pallasite.train.job"} <= set(modules)
    rules = imported("pallasite.sharding.rules", modules["pallasite.sharding.rules"], modules)
    assert {"pallasite.model", "pallasite.sharding.plan"} <= rules


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    modules = package_modules()
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert cycles(graph) == []
