"""The recipe's ops port with ``/status`` (``services/recipe/status_http.py``): the page and
its JSON beside the probes and metrics every ops port serves, which still answer as before."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from contextlib import AsyncExitStack

import httpx

from libs.common.config import ServiceConfig
from libs.common.service import ServiceContext
from libs.common.telemetry import OpsServer
from services.recipe.status import Scrape, StatusBoard
from services.recipe.status_collect import MAX_METRICS_BYTES, scrape
from services.recipe.status_http import status_routes
from services.recipe.status_page import PAGE


async def _get(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: ops\r\nAccept: */*\r\n\r\n".encode()


def test_status_routes_beside_the_probes_and_metrics() -> None:
    board = StatusBoard(2.0)

    async def main() -> None:
        health = lambda: (False, "entrypoint: connecting")  # noqa: E731
        ops = OpsServer("127.0.0.1", 0, health, status_routes(board))
        port = await ops.start()
        try:
            status, headers, body = await _get(port, get("/status"))
            assert status == 200 and headers["Content-Type"].startswith("text/html")
            assert "connect-src 'self'" in headers["Content-Security-Policy"]
            assert b'id="chart-hit"' in body and b'id="panel-kvstore"' in body
            status, headers, body = await _get(port, get("/status.json?x=1"))
            assert status == 200 and headers["Content-Type"] == "application/json"
            assert json.loads(body) == board.snapshot()
            assert headers["Cache-Control"] == "no-store"
            # The rest is OpsServer's, unchanged.
            status, _, body = await _get(port, get("/healthz"))
            assert status == 503 and json.loads(body)["detail"] == "entrypoint: connecting"
            assert (await _get(port, get("/livez")))[0] == 200
            status, headers, _ = await _get(port, get("/metrics"))
            assert status == 200 and headers["Content-Type"].startswith("text/plain")
            assert (await _get(port, get("/statusx")))[0] == 404
            assert (await _get(port, b"GET /livez HTTP/1.0\n\n"))[0] == 200, "bare newlines"
            # A client that sends nothing, or a line too long, is dropped; the port serves on.
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /status" + b"x" * (70 << 10) + b" HTTP/1.1\r\n\r\n")
            await writer.drain()
            writer.close()
            assert (await _get(port, get("/status.json")))[0] == 200
        finally:
            await ops.stop()

    asyncio.run(main())


def test_start_ops_with_status_routes_redacts_health_and_closes_with_the_stack() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            ctx = ServiceContext(
                "recipe",
                ServiceConfig(http_port=0),
                stack,
                asyncio.Event(),
                logging.getLogger("t"),
            )
            port = await ctx.start_ops(
                lambda: (False, "nats://user:hunter2@nats:4222 down"),
                status_routes(StatusBoard(1.0)),
            )
            status, _, body = await _get(port, get("/readyz"))
            assert status == 503 and b"hunter2" not in body
            assert (await _get(port, get("/status")))[0] == 200
        try:
            await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return
        raise AssertionError("the ops port is still open after the stack closed")

    asyncio.run(main())


def test_the_page_is_self_contained() -> None:
    """Nothing outside can be reached from where the stack runs: no URL, no external script,
    style, font or image; the one fetch is the relative ``status.json``."""
    assert not re.search(r"https?://", PAGE)
    assert not re.search(r"<(script|link|img|iframe)[^>]*(src|href)=", PAGE)
    assert not re.search(r"@import|url\(", PAGE)
    assert re.findall(r"fetch\(([^,)]*)", PAGE) == ['"status.json"']
    assert ".innerHTML" not in PAGE, "instance ids and target names are set as text"


def test_scrape_reports_each_failure_as_data() -> None:
    """An ops port that answers badly or not at all becomes a reason on the page."""
    bodies = {
        "ok:1": (
            200,
            b"# TYPE deepserve_entrypoint_retries counter\n"
            b'deepserve_entrypoint_retries_total{action="fresh"} 2\n',
        ),
        "err:1": (500, b"boom"),
        "junk:1": (200, b"this is { not metrics\n"),
        "big:1": (200, b"# x\n" * (MAX_METRICS_BYTES // 3)),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        host = f"{request.url.host}:{request.url.port}"
        if host not in bodies:
            raise httpx.ConnectError("connection refused", request=request)
        status, body = bodies[host]
        return httpx.Response(status, content=body)

    async def main() -> dict[str, Scrape]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            names = [*bodies, "gone:1"]
            return dict(zip(names, [await scrape(client, a) for a in names], strict=True))

    out = asyncio.run(main())
    assert out["ok:1"].counter("deepserve_entrypoint_retries_total") == 2
    assert out["ok:1"].counter("deepserve_entrypoint_rejected_total") == 0, "reached: none yet"
    assert out["err:1"].samples is None and out["err:1"].error == "HTTP 500"
    assert out["junk:1"].samples is None and "unreadable" in out["junk:1"].error
    assert out["big:1"].samples is None and "larger than" in out["big:1"].error
    assert out["gone:1"].samples is None and out["gone:1"].error.startswith("unreachable")
    assert out["gone:1"].counter("deepserve_entrypoint_retries_total") is None
