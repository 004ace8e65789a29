"""The balancer process over a real nats-server: heartbeats in, load-spread routes out."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from libs.common import subjects
from libs.proto.deepserve.v1 import control_pb2

from .svc import service

MODEL = "deepseek-tiny"


@pytest.fixture
def balancer(nats_url: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with service(
        "balancer",
        [
            "--nats-url",
            nats_url,
            "--heartbeat-timeout",
            "3.0",
            "--warmup-seconds",
            "0.2",
            "--drain-seconds",
            "2",
        ],
        tmp_path,
    ) as proc:
        yield proc


def status(name: str, role: int) -> bytes:
    return control_pb2.InstanceStatus(
        instance_id=name,
        role=role,
        model=MODEL,
        address=f"127.0.0.1:{5000 + int(name[1:])}" if role == control_pb2.ROLE_DECODE else "",
        free_kv_blocks=100,
        total_kv_blocks=100,
        sent_unix_ms=int(time.time() * 1000),
    ).SerializeToString()


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[nats.aio.client.Client]:
    nc = await nats.connect(nats_url)
    try:
        yield nc
    finally:
        await nc.close()


async def route(nc: nats.aio.client.Client, i: int) -> control_pb2.RouteDecision:
    req = control_pb2.RouteRequest(request_id=f"r{i}", model=MODEL, prompt_tokens=10)
    msg = await nc.request(subjects.ROUTE, req.SerializeToString(), timeout=2)
    return control_pb2.RouteDecision.FromString(msg.data)


async def test_routes_spread_and_silent_instances_drop_out(
    balancer: subprocess.Popen[bytes], client: nats.aio.client.Client
) -> None:
    nc = client
    beating = {
        "p1": control_pb2.ROLE_PREFILL,
        "p2": control_pb2.ROLE_PREFILL,
        "d1": control_pb2.ROLE_DECODE,
        "d2": control_pb2.ROLE_DECODE,
    }

    stop = asyncio.Event()

    async def heartbeats() -> None:
        # Ends on ``stop``, not only on cancel: Python 3.11's wait_for (inside nats-py) can
        # swallow a cancellation, and then the test would wait on this task forever.
        while not stop.is_set():
            for name, role in list(beating.items()):
                r = "prefill" if role == control_pb2.ROLE_PREFILL else "decode"
                await nc.publish(subjects.heartbeat(r, name), status(name, role))
            await asyncio.sleep(0.5)

    task = asyncio.create_task(heartbeats())
    try:
        await asyncio.sleep(0.3)
        got = [await route(nc, i) for i in range(6)]
        assert all(not d.error for d in got), [d.error for d in got]
        pre = [d.prefill_instance for d in got]
        dec = [d.decode_instance for d in got]
        # Equal instances share the load (what a replica routed counts until the next heartbeat;
        # ties go by a hash of the request id), so neither takes more than 4 of 6.
        assert set(pre) == {"p1", "p2"} and set(dec) == {"d1", "d2"}
        assert max(Counter(pre).values()) <= 4 and max(Counter(dec).values()) <= 4, (pre, dec)
        assert all(
            d.decode_address == f"127.0.0.1:{5000 + int(d.decode_instance[1:])}" for d in got
        )

        del beating["p2"], beating["d2"]  # these two go silent
        await asyncio.sleep(3.6)
        got = [await route(nc, i) for i in range(4)]
        assert {(d.prefill_instance, d.decode_instance) for d in got} == {("p1", "d1")}

        del beating["d1"]
        await asyncio.sleep(3.6)
        d = await route(nc, 99)
        assert "no live decode instance" in d.error and not d.prefill_instance
    finally:
        stop.set()
        task.cancel()
        await asyncio.wait({task}, timeout=5)

    balancer.terminate()  # SIGTERM: drains and exits cleanly
    assert balancer.wait(10) == 0


async def test_the_ops_port_exports_routing_reasons_live_instances_and_bucket_work(
    balancer: subprocess.Popen[bytes], client: nats.aio.client.Client
) -> None:
    args: Any = balancer.args
    http_port = int(args[-1])  # svc.service appends its --http-port last
    for name, role in (("p1", control_pb2.ROLE_PREFILL), ("d1", control_pb2.ROLE_DECODE)):
        r = "prefill" if role == control_pb2.ROLE_PREFILL else "decode"
        await client.publish(subjects.heartbeat(r, name), status(name, role))
    await client.flush()
    await asyncio.sleep(0.3)
    got = [await route(client, i) for i in range(3)]
    assert all(not d.error for d in got), [d.error for d in got]
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{http_port}/metrics", timeout=5)).text
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("deepserve:")
    )
    decisions = "deepserve:balancer_routing_decisions_total"
    assert float(samples[f'{decisions}{{reason="only_candidate",role="prefill"}}']) == 3
    assert float(samples[f'{decisions}{{reason="only_candidate",role="decode"}}']) == 3
    assert float(samples[f'{decisions}{{reason="cache_hit",role="prefill"}}']) == 0
    assert float(samples['deepserve:balancer_live_instances{role="prefill"}']) == 1
    assert float(samples['deepserve:balancer_live_instances{role="decode"}']) == 1
    buckets = {k: float(v) for k, v in samples.items() if "balancer_bucket_instances" in k}
    assert sum(buckets.values()) == 1 and len(buckets) == 5, buckets
