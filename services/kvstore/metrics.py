"""The kvstore's state metrics, named as the engine's (``deepserve:`` prefix,
``libs/serving/engine_metrics.py``), on the ops port's ``/metrics`` beside the RPC metrics of
``handlers.py``. Where each value comes from -- never an estimate:

* gauges ``deepserve:kvstore_stored_blocks`` / ``_stored_bytes``: the counters ``blocks`` /
  ``bytes`` of ``ds:kv:_stats`` in Redis, read at scrape time (one ``HMGET``; the Lua scripts
  that add or remove metadata keep them exact across every kvstore process); absent from a
  scrape while Redis does not answer;
* gauge ``deepserve:kvstore_capacity_bytes``: the configured capacity (0: no limit);
* gauge ``deepserve:kvstore_target_up{target}``: 1 when the target answered its latest probe
  (a read of a key that never exists: a healthy target says "no such key", one that is down
  raises :class:`~.targets.TargetDown`), 0 when not; probed every ``PROBE_INTERVAL_S`` seconds.
  ``target`` is the target's name (a directory or ``s3://bucket``), redacted like a URL;
* counters, incremented by :class:`~.store.BlockStore` and ``fsck`` where it happens:
  ``deepserve:kvstore_evictions_total{reason}`` (blocks removed by this process: ``capacity``,
  LRU tails over the capacity; ``ttl``, unused longer than their class's TTL; ``unreachable``,
  their parent is gone), ``deepserve:kvstore_degraded_reads_total`` (blocks a Get served from
  fewer than all of their data shards: rebuilt from parity because shards were down or
  damaged), ``deepserve:kvstore_repaired_shards_total{source}`` (shards rewritten, by a ``get``
  or by an in-process ``fsck``), ``deepserve:kvstore_lost_blocks_total`` (blocks dropped
  because fewer than ``k`` good shards were left on targets that answer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence

import redis
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from libs.common.redact import redact_text

from .scripts import STATS_KEY
from .targets import Target

PREFIX = "deepserve:"
EVICTION_REASONS = ("capacity", "ttl", "unreachable")
PROBE_INTERVAL_S = 5.0
PROBE_KEY = "probe/never-written"  # no shard key looks like this (``targets.parse_shard_key``)
STATS_TIMEOUT_S = 0.25  # a scrape reads Redis on the event loop: never wait long for it

log = logging.getLogger("kvstore.metrics")

StatsFn = Callable[[], tuple[int, int] | None]


class StoreMetrics:
    """The store's counters. ``registry``: where they are registered (None: a private one, so
    tests, ``fsck`` and several stores in one process never collide)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.evictions = Counter(
            PREFIX + "kvstore_evictions",
            "Blocks evicted by this process, by reason (capacity, ttl, unreachable)",
            ["reason"],
            registry=self.registry,
        )
        self.degraded_reads = Counter(
            PREFIX + "kvstore_degraded_reads",
            "Blocks a Get served from fewer than all of their data shards (rebuilt from parity)",
            registry=self.registry,
        )
        self.repaired_shards = Counter(
            PREFIX + "kvstore_repaired_shards",
            "Shards rewritten from their block's verified bytes, by source (get, fsck)",
            ["source"],
            registry=self.registry,
        )
        self.lost_blocks = Counter(
            PREFIX + "kvstore_lost_blocks",
            "Blocks dropped: fewer than k good shards on targets that answer",
            registry=self.registry,
        )
        for reason in EVICTION_REASONS:  # every series exported (at 0) from the start
            self.evictions.labels(reason)
        # Only "get" from the start: ``deepserve kvstore fsck`` runs in a process of its own
        # (its JSON report counts its repairs), so a service's "fsck" series would read 0.
        self.repaired_shards.labels("get")


class TargetHealth:
    """Whether each target answers, from a probe of every target in worker threads."""

    def __init__(self, targets: Sequence[Target]) -> None:
        self.targets = list(targets)
        self.up: dict[str, bool] = {}

    @staticmethod
    def probe(target: Target) -> bool:
        """Blocking: True when the target answers a read (a missing key is an answer)."""
        try:
            target.get(PROBE_KEY)
        except OSError:  # TargetDown, or a directory that cannot be read
            return False
        return True

    async def check(self) -> None:
        results = await asyncio.gather(*(asyncio.to_thread(self.probe, t) for t in self.targets))
        for t, ok in zip(self.targets, results):
            if self.up.get(t.name, True) and not ok:
                log.error("target %s is down", redact_text(t.name))
            elif self.up.get(t.name) is False and ok:
                log.info("target %s is up again", redact_text(t.name))
            self.up[t.name] = ok

    async def run(self, interval: float = PROBE_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.check()


class RedisStats:
    """``(blocks, bytes)`` from ``ds:kv:_stats``, read synchronously with a short timeout
    (a collector runs inside the scrape, on the event loop); None when Redis does not answer."""

    def __init__(self, url: str, timeout: float = STATS_TIMEOUT_S) -> None:
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def __call__(self) -> tuple[int, int] | None:
        try:
            blocks, size = self.client.hmget(STATS_KEY, ["blocks", "bytes"])
        except (RedisError, OSError):
            return None
        return int(blocks or 0), int(size or 0)

    def close(self) -> None:
        self.client.close()


class StoreCollector(Collector):
    """Gauges read at scrape time: the store's size from Redis, each target's health."""

    def __init__(self, stats: StatsFn, health: TargetHealth, capacity_bytes: int) -> None:
        self._stats, self._health, self._capacity = stats, health, capacity_bytes

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Registration asks for names here instead of calling collect() (no Redis read then).
        yield from self._families(None, {})

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families(self._stats(), self._health.up)

    def _families(
        self, stats: tuple[int, int] | None, up: dict[str, bool]
    ) -> Iterator[GaugeMetricFamily]:
        blocks = GaugeMetricFamily(PREFIX + "kvstore_stored_blocks", "Blocks stored (Redis)")
        size = GaugeMetricFamily(
            PREFIX + "kvstore_stored_bytes",
            "Block bytes stored (Redis; shards take (k+m)/k of this on the targets)",
        )
        if stats is not None:
            blocks.add_metric([], stats[0])
            size.add_metric([], stats[1])
        cap = GaugeMetricFamily(
            PREFIX + "kvstore_capacity_bytes", "Configured capacity in block bytes (0: no limit)"
        )
        cap.add_metric([], self._capacity)
        targets = GaugeMetricFamily(
            PREFIX + "kvstore_target_up",
            "1 when the storage target answered its latest probe, 0 when it is down",
            labels=["target"],
        )
        for name, ok in sorted(up.items()):
            targets.add_metric([redact_text(name)], 1.0 if ok else 0.0)
        yield from (blocks, size, cap, targets)
