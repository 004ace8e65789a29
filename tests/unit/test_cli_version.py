"""``deepserve --version`` says the version pyproject.toml declares, and the project says its
license where packaging tools look for it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from deepserve.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_declared_one(capsys: pytest.CaptureFixture[str]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"deepserve {project['version']}"
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
