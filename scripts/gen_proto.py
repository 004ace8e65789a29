#!/usr/bin/env python3
"""Generate Python code for every proto under proto/ into libs/proto/ (the one generator).

    python scripts/gen_proto.py            # write libs/proto/
    python scripts/gen_proto.py --out DIR  # write elsewhere (the staleness test compares)

Imports in the generated files are rewritten from ``deepserve.v1`` to
``libs.proto.deepserve.v1`` so the package imports from the repository root.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
DEFAULT_OUT = ROOT / "libs" / "proto"
_IMPORT = re.compile(r"^from deepserve\.v1 import ", re.MULTILINE)


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [str(p.relative_to(PROTO_DIR)) for p in protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        if out.exists():
            shutil.rmtree(out)
        written = []
        for src in sorted(Path(tmp).rglob("*.py*")):
            dst = out / src.relative_to(tmp)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(_IMPORT.sub("from libs.proto.deepserve.v1 import ", src.read_text()))
            written.append(dst)
    for pkg in {out, *(p.parent for p in written)}:
        d = pkg
        while d != out.parent:
            (d / "__init__.py").touch()
            d = d.parent
    return written


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    files = generate(ap.parse_args().out)
    print(f"generated {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
