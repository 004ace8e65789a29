"""The layers hold: ``libs/`` is a library the services use, never the other way round, and
policy modules do no I/O (STYLE.md 1-2). Read from the sources' import statements, so a
new import that breaks a layer fails here before it ships."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Packages of pure policy: importable and testable with no server, no network, no torch.
POLICY = [
    "libs/routing",
    "libs/gateway",
    "libs/kvstore",
    "libs/common/hashchain.py",
    "libs/engine/scheduler.py",
    "libs/engine/kv/block_manager.py",
    "libs/engine/ep/eplb.py",
    "libs/engine/ep/eplb_plan.py",
    "libs/engine/ep/placement.py",
]
# (asyncio is allowed: admission's Condition is a concurrency primitive, not I/O.)
IO_MODULES = {
    "grpc",
    "nats",
    "redis",
    "starlette",
    "uvicorn",
    "httpx",
    "boto3",
    "socket",
    "torch",
    "subprocess",
    "requests",
    "urllib",
}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                found.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.add(node.module)
    return found


def python_files(*places: str) -> list[Path]:
    out: list[Path] = []
    for place in places:
        p = ROOT / place
        out.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return out


def test_layer_check_sees_imports() -> None:
    """The checker itself: absolute imports, and relative ones resolved to their package."""
    found = imported_modules(ROOT / "libs" / "routing" / "policy.py")
    assert "libs.routing" in found  # from . import buckets
    assert "hashlib" in found


@pytest.mark.parametrize("path", python_files("libs"), ids=lambda p: str(p.relative_to(ROOT)))
def test_libs_import_no_service_or_tool(path: Path) -> None:
    bad = sorted(
        m for m in imported_modules(path) if m.split(".")[0] in ("services", "deepserve", "tests")
    )
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: libs/ must not depend on them"


@pytest.mark.parametrize("path", python_files(*POLICY), ids=lambda p: str(p.relative_to(ROOT)))
def test_policy_does_no_io(path: Path) -> None:
    bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in IO_MODULES)
    assert not bad, f"{path.relative_to(ROOT)} is policy but imports {bad}"
