"""scripts/mutants.py's list stays applicable: each planted bug still finds the one piece of code
it changes, still parses as Python, and names tests that exist. ``make mutants`` (the slow tier)
runs them; this keeps a refactor from turning a mutant into one that silently tests nothing --
when it fails, move the mutant's text or path along with the code."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
# The areas issue 39 asks the mutants to cover.
AREAS = (
    "hash chain",
    "MAC and frames",
    "scheduler accounting",
    "sampler rules",
    "grammar masks",
    "EC and shard checks",
    "tenant from the key",
    "routing",
    "admission",
    "API shapes",
    "cost model",
    "retry exactness",
)


def mutants() -> ModuleType:
    name = "scripts_mutants"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "mutants.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_every_mutant_applies_once_and_still_parses() -> None:
    listed = mutants().MUTANTS
    assert len(listed) >= 20 and len({m.id for m in listed}) == len(listed)
    for m in listed:
        source = m.where(ROOT).read_text()
        assert source.count(m.old) == 1, f"{m.id}: its text occurs {source.count(m.old)} times"
        assert m.new != m.old
        ast.parse(source.replace(m.old, m.new), filename=m.path)  # a bug, not a syntax error


def test_every_mutant_names_tests_that_exist() -> None:
    for m in mutants().MUTANTS:
        assert m.tests, m.id
        for node in m.tests:
            path, _, name = node.partition("::")
            assert (ROOT / path).is_file(), f"{m.id}: {path}"
            if name:
                assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), f"{m.id}: {node}"


def test_the_mutants_cover_every_area_the_issue_names() -> None:
    areas = " / ".join(m.area for m in mutants().MUTANTS)
    assert [a for a in AREAS if a not in areas] == []
