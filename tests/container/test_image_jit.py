"""The image can run its kernels (issue 38 item 1; container tier, ``make test-container``,
not ``make test``): Triton compiles a small C launcher with the system's C compiler against
Python's headers at the first kernel launch on a GPU, so an image without them fails there.
Inside each image ``scripts/docker/build.sh`` builds, Triton's own
``compile_module_from_src`` compiles and loads a C extension, Triton's real CUDA sources (its
``driver.c`` and a launcher from ``make_launcher``) compile with its bundled CUDA headers (no
GPU needed for that part: libcuda's symbols stay unresolved), then torch, Triton and every
service import, and every pin of requirements.lock is installed at its version
(``jit_probe.py``). Measured cold build times and sizes: docs/testing.md.

``DEEPSERVE_JIT_VARIANTS`` picks the images (default ``cpu,cuda``; the CUDA build pulls
PyTorch's CUDA wheels, several GB, the first time).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(3600)

ROOT = Path(__file__).resolve().parents[2]
DOCKER = os.environ.get("DOCKER") or (
    "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
)
VARIANTS = os.environ.get("DEEPSERVE_JIT_VARIANTS", "cpu,cuda").split(",")

PROBE = (Path(__file__).parent / "jit_probe.py").read_text()  # run by the image's python


@pytest.fixture(scope="module", params=VARIANTS)
def image(request: pytest.FixtureRequest) -> str:
    if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers: run `make test-container` (it starts one)")
    build = subprocess.run(
        ["bash", str(ROOT / "scripts/docker/build.sh"), request.param],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return build.stdout.strip().splitlines()[-1]  # build.sh prints the tag last


def test_triton_builds_its_launcher_and_everything_imports(image: str) -> None:
    out = subprocess.run(
        [DOCKER, "run", "--rm", "-i", "--entrypoint", "python", image, "-"],
        input=PROBE,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, f"{image}:\n{out.stdout}\n{out.stderr[-4000:]}"
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["services"] == 7 and found["triton"], found
    assert found["launcher"].startswith(("compiled", "linked")), found
    assert found["unlocked"] == [], found  # requirements.lock's pins, as make setup's
    if image.endswith(":cuda"):
        assert "+cpu" not in found["torch"], found  # a CUDA build of torch
