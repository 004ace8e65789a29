"""The import graph of ``libs/`` stays a hierarchy: no cycle between modules, none between the
files and folders of any package, and the engine library depends on nothing above it (issue 34).

Read from the sources' import statements with ``ast`` (every import counts: top-level, inside a
function, under ``TYPE_CHECKING`` -- each is a dependency a reader follows), nothing imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBS = ROOT / "libs"
GENERATED = ("libs/proto",)  # protoc's output: not ours to arrange


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for p in sorted(LIBS.rglob("*.py"))
        if not str(p.relative_to(ROOT)).startswith(GENERATED)
    }


def imports(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules ``name`` imports: absolute, relative ones resolved against its package;
    ``from package import sub`` is the submodule when ``sub`` is one."""
    known = set(known)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = package[: len(package) - (node.level - 1)]
                base = ".".join([*stem, node.module] if node.module else stem)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, mods) for name, path in mods.items()}


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def rooms(edges: Mapping[str, set[str]], package: str) -> dict[str, set[str]]:
    """``package``'s children (its modules and subpackages) and which of them import which."""

    def child(name: str) -> str | None:
        if not name.startswith(package + "."):
            return None
        return name[len(package) + 1 :].split(".")[0]

    out: dict[str, set[str]] = {}
    for name, targets in edges.items():
        a = child(name)
        if a is None:
            continue
        out.setdefault(a, set()).update(b for b in map(child, targets) if b is not None and b != a)
    return out


GRAPH = graph()
PACKAGES = sorted({"libs"} | {n for n, p in modules().items() if p.name == "__init__.py"})


def test_the_reader_resolves_imports() -> None:
    """The checker itself: relative imports, submodules named in ``from . import``, packages."""
    engine = GRAPH["libs.engine.engine"]
    assert {"libs.engine.scheduler", "libs.engine.kv_port", "libs.common.sampling"} <= engine
    assert "libs.engine.speculative" in engine  # from .speculative import SpecDecoder
    assert "libs.engine.kv.peer" in GRAPH["libs.engine.kv.cache"]  # from libs.engine.kv import peer
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert rooms({"p.x.m": {"p.y"}, "p.y": {"q"}}, "p") == {"x": {"y"}, "y": set()}


def test_no_module_of_libs_is_in_an_import_cycle() -> None:
    assert cycles(GRAPH) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_the_files_and_folders_of_a_package_import_without_a_cycle(package: str) -> None:
    """Each folder drawn as rooms (its files and subfolders): every import between them runs
    one way, so each stands above what it uses and nothing reaches back up."""
    assert cycles(rooms(GRAPH, package)) == [], f"{package}: its parts import each other"


def test_the_engine_depends_on_nothing_above_it() -> None:
    """libs/engine is the bottom of the serving stack: it imports the shared libs/common and
    itself, never the serving layer (libs/serving: the EP processes, the engine loop), the
    transports, the gateway or the services."""
    above = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if name.startswith("libs.engine")
        for target in targets
        if target.startswith("libs.") and not target.startswith(("libs.engine", "libs.common"))
    )
    assert above == []


def test_the_ep_layer_runs_no_processes() -> None:
    """libs/engine/ep is the layer around the model (group, dispatch, combine, placement,
    EPLB); launching ranks, lockstep and offline generation live in libs/serving/ep."""
    ep = {n.rsplit(".", 1)[-1] for n in GRAPH if n.startswith("libs.engine.ep.")}
    assert not ep & {"launch", "lockstep", "generate"}
    assert {"launch", "lockstep", "generate"} <= {
        n.rsplit(".", 1)[-1] for n in GRAPH if n.startswith("libs.serving.ep.")
    }
