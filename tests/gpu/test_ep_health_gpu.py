"""The EP supervisor's device probe on a real GPU (libs/serving/ep/health.py; the CPU tests
only ever see the health file): a working GPU probes healthy in a fresh process, a device
index the machine does not have probes unhealthy instead of failing the supervisor, and an
operator's health file still takes a working GPU out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.serving.ep.health import DeviceProbe, probe_cuda  # noqa: E402


def test_a_working_gpu_probes_healthy_and_a_missing_one_does_not() -> None:
    missing = torch.cuda.device_count()  # one past the last GPU
    assert asyncio.run(probe_cuda(0)) is True
    assert asyncio.run(probe_cuda(missing)) is False
    assert asyncio.run(DeviceProbe("cuda").healthy([missing, 0])) == [0]


def test_the_health_file_takes_a_working_gpu_out(tmp_path: Path) -> None:
    marks = tmp_path / "unhealthy"
    marks.write_text("0\n")
    assert asyncio.run(DeviceProbe("cuda", str(marks)).healthy([0])) == []
    marks.write_text("")
    assert asyncio.run(DeviceProbe("cuda", str(marks)).healthy([0])) == [0]
