"""An engine instance's model load as others see it while it happens: the loader's progress
(``libs/engine/load_progress.py``) turned into ``LoadStatus`` messages on
``ds.load.<role>.<instance>`` (the recipe's ``/status`` page shows them), gauges on the
instance's ``/metrics`` and a line in its ``/readyz`` answer.

Threads: the loader calls the report (its :data:`~libs.engine.load_progress.ProgressSink`) on
the load thread and only replaces one reference; the event loop reads it to publish, the ops
server's thread to answer a scrape. A preset (random weights, nothing read) reports no
shards: its messages say only that it is loading, then that it is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from nats.aio.client import Client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.engine.load_progress import LoadProgress
from libs.proto.deepserve.v1 import control_pb2

from .runtime import now_ms


class LoadReport:
    """One instance's load: ``report(progress)`` from the loader, :meth:`finish` once the
    engine is built (or failed), :meth:`message` / :meth:`line` / :meth:`collector` out."""

    def __init__(self, instance_id: str, role: str, model_name: str) -> None:
        self.instance_id, self.role, self.model_name = instance_id, role, model_name
        self.latest: LoadProgress | None = None
        self.error = ""
        self.finished = asyncio.Event()  # set on the event loop by finish()
        self._start = time.monotonic()

    def __call__(self, progress: LoadProgress) -> None:
        self.latest = progress  # one reference: atomic; the load thread does nothing else

    def finish(self, error: str = "") -> None:
        self.error = error
        self.finished.set()

    @property
    def done(self) -> bool:
        return self.finished.is_set() and not self.error

    def message(self) -> control_pb2.LoadStatus:
        p = self.latest
        msg = control_pb2.LoadStatus(
            instance_id=self.instance_id,
            role=self.role,
            model=self.model_name,
            seconds=p.seconds if p is not None else time.monotonic() - self._start,
            done=self.done,
            error=self.error,
        )
        if p is not None:
            msg.source = p.source
            msg.shards_done, msg.shards_total = p.shards_done, p.shards_total
            msg.bytes_done, msg.bytes_total = p.bytes_done, p.bytes_total
            msg.bytes_read = p.bytes_read
        return msg

    def line(self) -> str:
        """``/readyz``'s reason while loading."""
        p = self.latest
        if p is None or not p.shards_total:
            return "loading the model"
        if p.done:  # the engine is still being set up (KV cache, kernels, grammar): seconds
            return (
                f"weights loaded ({p.shards_total} shards, {p.read_bytes_per_s / 1e9:.2f} GB/s); "
                "preparing the engine"
            )
        eta = "" if p.eta_s is None else f", about {p.eta_s:.0f} s left"
        return (
            f"loading the model: {100 * p.fraction:.0f}% ({p.shards_done}/{p.shards_total} "
            f"shards, {p.read_bytes_per_s / 1e9:.2f} GB/s{eta})"
        )

    def collector(self) -> Collector:
        return _LoadCollector(self)


class _LoadCollector(Collector):
    """``deepserve_model_load_*`` gauges at scrape time, by ``model_name``."""

    def __init__(self, report: LoadReport) -> None:
        self.report = report

    def collect(self) -> Iterator[GaugeMetricFamily]:
        r, p = self.report, self.report.latest
        fraction = 1.0 if r.done else p.fraction if p is not None and p.shards_total else 0.0
        seconds = p.seconds if p is not None else 0.0
        for name, text, value in (
            ("fraction", "share of the checkpoint's bytes loaded, 0..1 (1: loaded)", fraction),
            (
                "read_bytes_per_second",
                "bytes read from the checkpoint per second of the load so far",
                p.read_bytes_per_s if p is not None else 0.0,
            ),
            ("seconds", "seconds the weights have taken to load so far (or in all)", seconds),
        ):
            g = GaugeMetricFamily(f"deepserve_model_load_{name}", text, labels=["model_name"])
            g.add_metric([r.model_name], value)
            yield g


async def publish_load(
    nc: asyncio.Future[Client | None],
    subject: str,
    report: LoadReport,
    log: logging.Logger,
    interval: float = 1.0,
) -> None:
    """``report.message()`` on ``subject`` every ``interval`` seconds once NATS is connected,
    until the report is finished; then the last one (done, or the error)."""
    client = await nc
    if client is None:
        return
    while True:
        last = report.finished.is_set()
        msg = report.message()
        msg.sent_unix_ms = now_ms()
        try:
            await client.publish(subject, msg.SerializeToString())
        except Exception as exc:  # noqa: BLE001 - progress is informational; the next may get through
            log.warning("load progress on %s failed: %s", subject, exc)
        if last:
            return
        try:
            await asyncio.wait_for(report.finished.wait(), interval)
        except TimeoutError:
            pass
