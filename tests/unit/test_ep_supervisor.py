"""An EP instance's supervisor re-derives its group from the healthy devices (issue 36 item 4):
a rank is killed while its device goes bad; the group restarts at the healthy count on the
other device (not on the failed one, as a group placed by position would), stays there while
the device is still unhealthy, and grows back to full size once it is healthy again.

CPU ranks have no GPU to probe, so the test marks a "device" unhealthy with
``--ep-health-file``; the ranks are stand-ins (``ep_fake_rank.py``) that fail as a real
group's ranks do when a peer dies, so the test runs in seconds. The real CUDA probe is checked
to report a device it cannot use."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch

from libs.common.config import ServiceConfig
from libs.common.service import ServiceContext
from libs.serving.ep import EXIT_GROUP_FAILED, EPFlags
from libs.serving.ep.health import DeviceProbe, listed_unhealthy
from libs.serving.ep_supervisor import EPSupervisor, Group

FAKE_RANK = [sys.executable, str(Path(__file__).with_name("ep_fake_rank.py"))]
REGROW_S = 1.0


async def _serving(sup: EPSupervisor, generation: int, timeout: float = 20.0) -> Group:
    """The group of ``generation`` once every rank of it answers /healthz."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = sup.group
        if g is not None and g.generation == generation and g.healthy:
            return g
        await asyncio.sleep(0.05)
    raise AssertionError(f"generation {generation} not serving: {sup.health()}")


async def test_a_lost_rank_s_device_is_left_out_then_the_group_grows_back(
    tmp_path: Path,
) -> None:
    unhealthy = tmp_path / "unhealthy-devices"
    ep = EPFlags(size=2, timeout_s=2.0, regrow_s=REGROW_S, health_file=str(unhealthy))
    async with AsyncExitStack() as stack:
        ctx = ServiceContext(
            "decode",
            ServiceConfig(instance_id="d", drain_seconds=1.0),
            stack,
            asyncio.Event(),
            logging.getLogger("test.ep_supervisor"),
        )
        sup = EPSupervisor(ctx, "decode", [], ep, own_grpc_port=False, command=FAKE_RANK)
        run = asyncio.create_task(sup.run())
        t0 = time.monotonic()
        try:
            g0 = await _serving(sup, 0)
            assert [(r.rank, r.device) for r in g0.ranks] == [(0, 0), (1, 1)]

            unhealthy.write_text("0\n")  # device 0 goes bad and takes rank 0 with it
            os.kill(g0.ranks[0].proc.pid, signal.SIGKILL)
            g1 = await _serving(sup, 1)
            assert g0.ranks[1].proc.returncode == EXIT_GROUP_FAILED  # the survivor noticed
            assert [(r.rank, r.device) for r in g1.ranks] == [(0, 1)], sup.health()
            assert g1.size == 1 and "d-r0-g1@" in sup.health()[1] and "slot 1" in sup.health()[1]

            await asyncio.sleep(2.5 * REGROW_S)  # probed again: still unhealthy, no restart
            assert sup.group is g1 and g1.ranks[0].proc.returncode is None

            unhealthy.write_text("")  # healthy again: the group grows back to both devices
            g2 = await _serving(sup, 2)
            assert [(r.rank, r.device) for r in g2.ranks] == [(0, 0), (1, 1)]
            assert g1.ranks[0].proc.returncode is not None  # drained, not left running
            print(f"kill, restart smaller, grow back: {time.monotonic() - t0:.1f}s")
        finally:
            ctx.stop.set()
            assert await asyncio.wait_for(run, 20) == 0
    assert all(r.proc.returncode is not None for r in g2.ranks)
    assert sup.restarts == 1


def test_the_health_file_lists_devices_and_ignores_typos(tmp_path: Path) -> None:
    f = tmp_path / "bad"
    assert listed_unhealthy(str(f)) == set() and listed_unhealthy("") == set()
    f.write_text("3\n1 x\n")
    assert listed_unhealthy(str(f)) == {1, 3}
    assert asyncio.run(DeviceProbe("cpu", str(f)).healthy([0, 1, 2, 3])) == [0, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a GPU that cannot be used")
def test_the_cuda_probe_reports_a_gpu_it_cannot_use() -> None:
    assert asyncio.run(DeviceProbe("cuda", timeout_s=60).healthy([0])) == []
