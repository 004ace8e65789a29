"""Kubernetes probes on every service's ops port (``libs/common/telemetry.py``): ``/livez``
answers 200 while the process's event loop runs, whatever the service's state, so a NATS or
Redis outage never gets a pod restarted; ``/readyz`` (and ``/healthz``, its alias) is 200 only
while the service is ready to take work, else 503 with the reason."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import AsyncExitStack

from libs.common.config import ServiceConfig
from libs.common.service import ServiceContext
from libs.common.telemetry import OpsServer


async def _get(port: int, path: str) -> tuple[int, dict[str, str]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, (json.loads(body) if body.startswith(b"{") else {})


def test_livez_is_up_while_readyz_follows_health() -> None:
    state = {"ok": False, "why": "nats: connecting"}

    async def main() -> None:
        ops = OpsServer("127.0.0.1", 0, lambda: (bool(state["ok"]), str(state["why"])))
        port = await ops.start()
        try:
            assert await _get(port, "/livez") == (200, {"status": "ok"})
            for path in ("/readyz", "/healthz"):
                status, body = await _get(port, path)
                assert status == 503
                assert body == {"status": "unavailable", "detail": "nats: connecting"}
            state.update(ok=True, why="serving")
            for path in ("/readyz", "/healthz", "/readyz?verbose=1"):
                assert await _get(port, path) == (200, {"status": "ok", "detail": "serving"})
            assert (await _get(port, "/livez"))[0] == 200
            assert (await _get(port, "/livezz"))[0] == 404
            assert (await _get(port, "/ready"))[0] == 404
        finally:
            await ops.stop()

    asyncio.run(main())


def test_livez_does_not_ask_the_service() -> None:
    calls: list[int] = []

    def health() -> tuple[bool, str]:
        calls.append(1)
        raise AssertionError("liveness must not depend on the service's health function")

    async def main() -> None:
        ops = OpsServer("127.0.0.1", 0, health)
        port = await ops.start()
        try:
            assert (await _get(port, "/livez"))[0] == 200
        finally:
            await ops.stop()

    asyncio.run(main())
    assert calls == []


def test_service_context_serves_probes_with_redacted_detail() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            ctx = ServiceContext(
                "test",
                ServiceConfig(instance_id="test-1"),
                stack,
                asyncio.Event(),
                logging.getLogger("test"),
            )
            port = await ctx.start_ops(lambda: (False, "redis://:hunter2@redis:6379 down"))
            assert (await _get(port, "/livez"))[0] == 200
            status, body = await _get(port, "/readyz")
            assert status == 503 and "hunter2" not in body["detail"]
        # The stack closed the ops port with the service.
        try:
            await _get(port, "/livez")
        except OSError:
            return
        raise AssertionError("the ops port still answers after the stack closed")

    asyncio.run(main())
