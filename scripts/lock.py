"""Writes requirements.lock: every package the services need at run time, pinned (``==``) at
the version this virtualenv runs: pyproject.toml's ``dependencies`` and everything they
require, torch's own closure left out (the CPU build, a GPU host's CUDA build or the GPU
image's come from scripts/install-torch.sh, and they pin their own).

One lock for every place the stack runs: ``make setup`` installs under it (``-c``), the
image installs it (``pip install -r``), and scripts/gpu/bundle.sh packs every pin the GPU
stack imports at its version, ahead of the device's own copies. ``--check`` exits 1, naming
the difference, when the file is not what this virtualenv would write
(tests/unit/test_lock.py runs it). ``--installed`` reports which pins this Python has at
another version or not at all (exit 1 with ``--strict``), past those ``--left-out`` names: the
GPU bundle's activation runs it on the device with the packages it leaves out.

    .venv/bin/python scripts/lock.py [--check | --installed [--strict] [--left-out a,b]]
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
SKIP = {"torch"}  # and what only torch requires: its build brings its own
HEADER = (
    "# The services' run-time packages, pinned: made by `make lock` (scripts/lock.py) from the\n"
    "# virtualenv that passed the tests. Installed by make setup (-c), docker/Dockerfile (-r)\n"
    "# and the GPU bundle (scripts/gpu/bundle.sh). torch is not here (scripts/install-torch.sh).\n"
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """{canonical name: installed version} of ``roots`` and what they require in this
    environment (markers evaluated; extras of a requirement followed), torch not entered."""
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if name in SKIP or name in found:
            continue
        dist = metadata.distribution(req.name)  # PackageNotFoundError: not installed here
        found[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            env = [{"extra": e} for e in req.extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(e) for e in env):
                todo.append(sub)
    return found


def render() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = closure(list(project["dependencies"]))
    return HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def pins(text: str) -> dict[str, str]:
    """{name: version} of a lock file's text."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[name] = version
    return out


def differences(locked: dict[str, str]) -> list[str]:
    """``name installed (lock X)`` for each pin this Python does not have at its version."""
    out = []
    for name, want in sorted(locked.items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "missing"
        if have != want:
            out.append(f"{name} {have} (lock {want})")
    return out


def left_out(argv: list[str]) -> set[str]:
    """The pins named by ``--left-out a,b,...``: packages a machine does without on purpose
    (the GPU bundle's: its own torch build's triton, the S3 tier it does not start)."""
    for i, arg in enumerate(argv):
        if arg == "--left-out" and i + 1 < len(argv):
            return {canonical(n) for n in argv[i + 1].split(",") if n}
        if arg.startswith("--left-out="):
            return {canonical(n) for n in arg.split("=", 1)[1].split(",") if n}
    return set()


def main(argv: list[str]) -> int:
    if "--installed" in argv:
        locked = pins(LOCK.read_text())
        left = left_out(argv)
        kept = {n: v for n, v in locked.items() if n not in left}
        differ = differences(kept)
        print(
            f"requirements.lock: {len(kept) - len(differ)} of {len(kept)} packages at the "
            "lock's versions"
            + ("; differ: " + ", ".join(differ) if differ else "")
            + (f" (left out here: {', '.join(sorted(left))})" if left else "")
        )
        return 1 if differ and "--strict" in argv else 0
    text = render()
    if "--check" in argv:
        have = LOCK.read_text() if LOCK.exists() else ""
        if have != text:
            old, new = set(have.splitlines()), set(text.splitlines())
            print(
                "requirements.lock is not what this virtualenv runs (make lock):\n"
                + "".join(f"  - {line}\n" for line in sorted(old - new))
                + "".join(f"  + {line}\n" for line in sorted(new - old)),
                file=sys.stderr,
            )
            return 1
        return 0
    LOCK.write_text(text)
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(pins(text))} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
