"""The committed generated code is what scripts/gen_proto.py makes from proto/ today."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_proto  # noqa: E402


def test_generated_proto_code_is_fresh(tmp_path: Path) -> None:
    fresh = tmp_path / "proto"
    gen_proto.generate(fresh)
    committed = ROOT / "libs" / "proto"
    fresh_files = {p.relative_to(fresh): p.read_text() for p in fresh.rglob("*.py*")}
    committed_files = {
        p.relative_to(committed): p.read_text()
        for p in committed.rglob("*.py*")
        if "__pycache__" not in p.parts
    }
    stale = sorted(
        str(k)
        for k in fresh_files.keys() | committed_files.keys()
        if fresh_files.get(k) != committed_files.get(k)
    )
    assert not stale, f"libs/proto is stale; run `python scripts/gen_proto.py` ({', '.join(stale)})"
