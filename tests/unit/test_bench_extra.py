"""`pip install 'deepserve[bench]'` is enough for `deepserve bench serve --url` (issue 38 item 7):
every package its code imports is a runtime dependency or in the bench extra -- none only in
the test extra."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What `bench serve --url` runs: the CLI dispatches to http_load.run, which reads engine_view,
# deals sessions over client processes (http_procs) and draws the plot (http_plot).
SERVE_URL_MODULES = ("deepserve/cli.py", "deepserve/bench/http_load.py")
SERVE_URL_MODULES += ("deepserve/bench/engine_view.py", "deepserve/bench/traces.py")
SERVE_URL_MODULES += ("deepserve/bench/http_procs.py", "deepserve/bench/http_plot.py")
OURS = {"deepserve", "libs", "services"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def third_party_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in OURS}


def test_bench_extra_covers_what_bench_serve_url_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]}
    bench = {_name(r) for r in project["optional-dependencies"]["bench"]}
    dists = packages_distributions()
    missing = {}
    for rel in SERVE_URL_MODULES:
        for module in third_party_imports(ROOT / rel):
            names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
            if not names & (base | bench):
                missing[module] = rel
    assert not missing, f"imported by bench serve --url but not in deps or [bench]: {missing}"
    # The ones the issue named, which once came only with the test extra.
    assert {"openai", "matplotlib", "tqdm"} <= bench


def test_the_scan_sees_lazy_imports() -> None:
    found = third_party_imports(ROOT / "deepserve/bench/http_load.py")
    found |= third_party_imports(ROOT / "deepserve/bench/http_plot.py")
    assert {"openai", "tqdm", "matplotlib"} <= found  # imported inside functions
