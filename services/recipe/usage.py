"""Usage records: one JSON record per request that reached the model, on a JetStream stream.

**Which requests.** A record is written for every request the backend accepted (its ``Ready``
came: the prompt was admitted and its prefill paid for), however it ended: ``ok``, ``error``
(the backend failed after Ready; the tokens produced until then are counted) or
``client_gone`` (the client left; likewise). Requests refused before Ready (400, 401, 404, 429,
a 503 at start) cost no model time and have no record.

**Where.** Stream ``DEEPSERVE_USAGE`` (``--usage-stream``; file storage, so records survive a
NATS restart), subject ``ds.usage.<tenant label>`` (the deployment's salted hash of the tenant,
as in metric labels: a subject never carries a tenant's name; the record does, so the stream
must be as private as the rest of the serving network; ``deepserve usage --tenant`` picks a
tenant's records by the name in them). Each message carries
``Nats-Msg-Id: <request id>``, so a publish retried after a lost ack is stored once. The
recipe creates the stream at start when it is missing; no retention limit is set (billing
data: its age limit is the operator's choice, ``nats stream edit``).

**Never in the way of a response.** :meth:`UsagePublisher.submit` only queues (bounded by
``--usage-queue``); one background task connects to NATS (retrying, without delaying the
recipe's start), creates the stream and publishes, retrying each record a few times. A full
queue or a record that still fails is dropped and counted in
``deepserve_recipe_usage_records_total{outcome}``. At shutdown the queue is flushed for up to
``--drain-seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.api import StorageType
from nats.js.errors import Error as JsError
from nats.js.errors import NotFoundError
from prometheus_client import Counter

from libs.common.natsutil import close_nats, connect_nats
from libs.common.tenant_label import UNSALTED, TenantLabels

STREAM = "DEEPSERVE_USAGE"
SUBJECT_PREFIX = "ds.usage"
PUBLISH_TIMEOUT_S = 5.0
PUBLISH_ATTEMPTS = 4  # then the record is dropped and counted (outcome="failed")


def subject_of(tenant: str, labels: TenantLabels = UNSALTED) -> str:
    """The subject of ``tenant``'s records: its label, never its name."""
    return f"{SUBJECT_PREFIX}.{labels(tenant)}"


@dataclass(frozen=True)
class UsageRecord:
    """One request's usage. Times are UNIX seconds (UTC); ``tenant`` is ``""`` on an open
    API; ``key_id`` the key's non-secret id (``""`` with no key), never the key. Token counts
    are those of the response's usage (``completion_tokens`` without the EOS token)."""

    request_id: str
    tenant: str
    key_id: str
    model: str
    route: str  # chat_completions, completions, responses, messages
    status: str  # ok, error, client_gone
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    started_at: float
    finished_at: float

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "uncached_tokens": self.uncached_tokens}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> UsageRecord:
        """A record read back; ValueError (or KeyError/TypeError) when it is not one."""
        d: dict[str, Any] = json.loads(data)
        return cls(
            request_id=str(d["request_id"]),
            tenant=str(d["tenant"]),
            key_id=str(d["key_id"]),
            model=str(d["model"]),
            route=str(d.get("route", "")),
            status=str(d["status"]),
            prompt_tokens=int(d["prompt_tokens"]),
            cached_tokens=int(d["cached_tokens"]),
            completion_tokens=int(d["completion_tokens"]),
            started_at=float(d["started_at"]),
            finished_at=float(d["finished_at"]),
        )


class UsageSink(Protocol):
    def submit(self, record: UsageRecord) -> None:
        """Take a record; never blocks, never raises."""
        ...


async def ensure_stream(nc: Client, stream: str = STREAM) -> None:
    """Create the usage stream (file storage, subjects ``ds.usage.>``) unless it exists."""
    jsm = nc.jsm()
    try:
        await jsm.stream_info(stream)
    except NotFoundError:
        await jsm.add_stream(
            name=stream, subjects=[f"{SUBJECT_PREFIX}.>"], storage=StorageType.FILE
        )


class UsagePublisher:
    """Queues records and publishes them to JetStream in the background (see the module doc)."""

    def __init__(
        self,
        nats_url: str,
        name: str,
        stream: str,
        queue_size: int,
        counter: Counter,
        stop: asyncio.Event,
        log: logging.Logger,
        retry_wait_s: float = 1.0,
        labels: TenantLabels = UNSALTED,
    ) -> None:
        self.nats_url, self.name, self.stream = nats_url, name, stream
        self.labels = labels
        self.queue: asyncio.Queue[UsageRecord] = asyncio.Queue(queue_size)
        self.counter, self.stop, self.log = counter, stop, log
        self.retry_wait_s = retry_wait_s
        self.nc: Client | None = None
        self._task: asyncio.Task[None] | None = None

    def submit(self, record: UsageRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except asyncio.QueueFull:
            self.counter.labels("dropped_queue_full").inc()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-publisher")

    async def _run(self) -> None:
        self.nc = await connect_nats(self.nats_url, self.name, self.stop, self.log)
        if self.nc is None:
            return  # stopped before NATS came
        while True:
            try:
                await ensure_stream(self.nc, self.stream)
                break
            except (NatsError, JsError, TimeoutError) as exc:
                self.log.warning("usage stream %s not ready (%s); retrying", self.stream, exc)
                await asyncio.sleep(self.retry_wait_s)
        self.log.info("usage records go to JetStream stream %s", self.stream)
        js = self.nc.jetstream()
        while True:
            record = await self.queue.get()
            try:
                await self._publish(js, record)
            finally:
                self.queue.task_done()

    async def _publish(self, js: Any, record: UsageRecord) -> None:
        for attempt in range(PUBLISH_ATTEMPTS):
            try:
                await js.publish(
                    subject_of(record.tenant, self.labels),
                    record.to_json(),
                    timeout=PUBLISH_TIMEOUT_S,
                    stream=self.stream,
                    headers={"Nats-Msg-Id": record.request_id},
                )
                self.counter.labels("published").inc()
                return
            except (NatsError, JsError, TimeoutError) as exc:
                if attempt + 1 == PUBLISH_ATTEMPTS:
                    self.counter.labels("failed").inc()
                    self.log.warning(
                        "usage record of request %s dropped after %d attempts: %s",
                        record.request_id,
                        PUBLISH_ATTEMPTS,
                        exc,
                    )
                    return
                await asyncio.sleep(self.retry_wait_s * (attempt + 1))

    async def close(self, flush_s: float) -> None:
        """Publish what is queued (for up to ``flush_s`` seconds), then stop and disconnect."""
        if self._task is not None and not self._task.done() and self.nc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.queue.join(), flush_s)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.queue.qsize():
            self.counter.labels("failed").inc(self.queue.qsize())
            self.log.warning("%d usage records not published at exit", self.queue.qsize())
        if self.nc is not None:
            await close_nats(self.nc, self.log, None)
