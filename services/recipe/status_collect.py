"""The I/O behind the recipe's ``/status`` page: a background task that feeds the
:class:`~.status.StatusBoard`, never a request handler.

* NATS (its own connection, ``<instance>-status``, connected in the background like the usage
  publisher's): every ``InstanceStatus`` on ``ds.heartbeat.>`` and every ``LoadStatus`` on
  ``ds.load.>`` (an instance loading its model) goes to the board as it comes.
* Every ``interval`` seconds: the recipe's own counters (``Metrics``: responses by status,
  prompt and cached tokens, summed over tenants) and one ``GET /metrics`` of each configured
  ops port (balancer: bucket placement; entrypoint: retries; kvstore: capacity, targets,
  degraded reads), all at once, each bounded by ``timeout``. A port that does not answer is
  shown as unreachable on the page; nothing here raises into the service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

import httpx
from google.protobuf.message import DecodeError
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.common import subjects
from libs.common.natsutil import close_nats, connect_nats
from libs.common.redact import redact_text
from libs.proto.deepserve.v1 import control_pb2

from .handlers import Metrics
from .status import Counters, Scrape, StatusBoard, parse_metrics

# The most the metrics text of one ops port may be (an entrypoint's is ~10 KB).
MAX_METRICS_BYTES = 1 << 20
RETRIES = "deepserve_entrypoint_retries_total"  # services/entrypoint/metrics.py
DEGRADED_READS = "deepserve:kvstore_degraded_reads_total"  # services/kvstore/metrics.py


def own_counters(metrics: Metrics, t: float) -> Counters:
    """The recipe's cumulative counts, from its registry's collectors (no scrape)."""
    requests = errors = rejected = 0.0
    for family in metrics.requests.collect():
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            requests += s.value
            status = s.labels.get("status", "")
            if status.startswith("5"):
                errors += s.value
            elif status == "429":
                rejected += s.value
    tokens: dict[str, float] = {}
    for family in metrics.tokens.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                kind = s.labels.get("kind", "")
                tokens[kind] = tokens.get(kind, 0.0) + s.value
    return Counters(
        t=t,
        requests=requests,
        errors=errors,
        rejected=rejected,
        prompt_tokens=tokens.get("prompt", 0.0),
        cached_tokens=tokens.get("cached", 0.0),
    )


async def scrape(client: httpx.AsyncClient, address: str) -> Scrape:
    """``GET http://<address>/metrics``, parsed; an unreachable port or bad text is a
    :class:`Scrape` with ``samples`` None and the reason."""
    try:
        body = bytearray()
        async with client.stream("GET", f"http://{address}/metrics") as r:
            r.raise_for_status()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    return Scrape(address, None, f"metrics larger than {MAX_METRICS_BYTES} bytes")
        return Scrape(address, parse_metrics(body.decode("utf-8", "replace")))
    except httpx.HTTPStatusError as exc:
        return Scrape(address, None, f"HTTP {exc.response.status_code}")
    except httpx.HTTPError as exc:
        return Scrape(address, None, redact_text(f"unreachable: {type(exc).__name__} {exc}"))
    except ValueError as exc:  # not the Prometheus text format
        return Scrape(address, None, f"unreadable metrics: {exc}")


class StatusCollector:
    """Runs until cancelled (``ctx.background``); closes its NATS connection on the way out."""

    def __init__(
        self,
        board: StatusBoard,
        metrics: Metrics,
        nats_url: str,
        name: str,
        kvstores: Sequence[str],
        balancers: Sequence[str],
        entrypoints: Sequence[str],
        stop: asyncio.Event,
        log: logging.Logger,
    ) -> None:
        self.board, self.metrics = board, metrics
        self.nats_url, self.name = nats_url, name
        self.kvstores, self.balancers = list(kvstores), list(balancers)
        self.entrypoints = list(entrypoints)
        self.stop, self.log = stop, log
        self.nc: Client | None = None
        self.timeout = max(0.2, min(1.0, board.interval / 2))

    async def run(self) -> None:
        listen = asyncio.create_task(self._listen(), name="status-heartbeats")
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                failing = ""
                while True:
                    try:
                        await self._tick(client)
                        failing = ""
                    except Exception as exc:  # a bug here must not end the page's updates
                        if repr(exc) != failing:  # once per new failure, not every tick
                            self.log.exception("status: collecting failed")
                        failing = repr(exc)
                    await asyncio.sleep(self.board.interval)
        finally:
            listen.cancel()
            await asyncio.gather(listen, return_exceptions=True)
            if self.nc is not None:
                await close_nats(self.nc, self.log)

    async def _listen(self) -> None:
        self.nc = await connect_nats(self.nats_url, self.name, self.stop, self.log)
        if self.nc is None:
            return

        async def on_heartbeat(msg: Msg) -> None:
            try:
                self.board.observe(control_pb2.InstanceStatus.FromString(msg.data))
            except DecodeError:
                pass  # the balancer counts and logs bad heartbeats; the page just skips them

        async def on_load(msg: Msg) -> None:
            try:
                self.board.observe_load(control_pb2.LoadStatus.FromString(msg.data))
            except DecodeError:
                pass

        await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_heartbeat)
        await self.nc.subscribe(subjects.LOAD_ALL, cb=on_load)

    def _nats_state(self) -> tuple[bool, str]:
        if self.nc is None:
            return False, "connecting to NATS"
        if not self.nc.is_connected:
            return False, "NATS disconnected; reconnecting"
        return True, "connected; heartbeats from ds.heartbeat.>"

    async def _tick(self, client: httpx.AsyncClient) -> None:
        async def scrape_all(addresses: Sequence[str]) -> list[Scrape]:
            return list(await asyncio.gather(*(scrape(client, a) for a in addresses)))

        kv, bal, ep = await asyncio.gather(
            scrape_all(self.kvstores), scrape_all(self.balancers), scrape_all(self.entrypoints)
        )
        # Summed over every configured process, so unknown while any one is not reached (a
        # sum over fewer would read as a counter reset).
        counters = replace(
            own_counters(self.metrics, time.monotonic()),
            retries=_sum_all(s.counter(RETRIES) for s in ep),
            degraded_reads=_sum_all(s.counter(DEGRADED_READS) for s in kv),
        )
        self.board.tick(counters, kv, bal, ep, self._nats_state())


def _sum_all(values: Iterable[float | None]) -> float | None:
    """The sum, or None when there is nothing to sum or any value is unknown."""
    listed = list(values)
    if not listed or any(v is None for v in listed):
        return None
    return sum(v for v in listed if v is not None)
