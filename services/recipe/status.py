"""What the recipe's ``/status`` page shows, aggregated without I/O (``status_collect.py``
feeds it; ``status_http.py`` serves it).

Inputs, each a plain value: heartbeats (``InstanceStatus`` from ``ds.heartbeat.<role>.<id>``),
instances loading their model (``LoadStatus`` from ``ds.load.<role>.<id>``: ``status_load.py``),
the recipe's own counters (requests by status, prompt and cached tokens), and samples scraped
from other services' ops ports (``/metrics`` text): the balancer's
``deepserve:balancer_prefill_bucket`` (which bucket each prefill instance serves), the
entrypoint's ``deepserve_entrypoint_retries_total`` and the kvstore's capacity, stored bytes,
per-target health and degraded reads (``services/kvstore/metrics.py``; its ``Stats`` RPC has
only blocks and bytes). Output: one JSON-ready snapshot per collector tick, with a bounded
history (``history_s`` seconds of points) of the rates that the page draws over time.

Nothing here names a tenant or a key: token and request counts are summed over tenants.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from libs.proto.deepserve.v1 import control_pb2
from libs.routing.heartbeat import role_of
from libs.routing.policy import ANY_BUCKET

from .status_load import LoadTable

# The balancer's default --heartbeat-timeout: an instance silent longer is not routed to.
SILENT_AFTER_S = 3.0
# A silent instance stays on the page (marked) this long, then is forgotten.
FORGET_AFTER_S = 30.0
# Heartbeats are internal traffic, but the table stays bounded whatever arrives on the bus.
MAX_INSTANCES = 4096
# Each rate (hit rate, errors/s, ...) is taken over the samples of the last 10 s, so a point
# of the "over time" charts is neither one 2 s interval's noise nor a minute's average.
RATE_WINDOW_S = 10.0
UNKNOWN_BUCKET = "unknown"  # a prefill instance no balancer (reached) has placed

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Samples:
    """Prometheus text → samples by sample name (``..._total`` for counters); ValueError for
    text that is not the exposition format."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


@dataclass(frozen=True)
class Scrape:
    """One ops port's ``/metrics`` as scraped this tick; ``samples`` None: not reached."""

    address: str
    samples: Samples | None
    error: str = ""

    def total(self, name: str) -> float | None:
        """The sum of ``name`` over its label sets; None when absent or not scraped."""
        if self.samples is None or name not in self.samples:
            return None
        return sum(v for _, v in self.samples[name])

    def counter(self, name: str) -> float | None:
        """A counter's sum; 0 when the port answered without it (a labelled counter has no
        series before its first increment), None when the port was not reached."""
        if self.samples is None:
            return None
        return self.total(name) or 0.0

    def source(self) -> dict[str, Any]:
        return {"address": self.address, "ok": self.samples is not None, "error": self.error}


def _sum_present(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


@dataclass(frozen=True)
class Instance:
    """The part of a heartbeat the page shows (resident prefixes and addresses are not)."""

    instance_id: str
    role: str
    model: str
    running: int
    waiting: int
    queued_tokens: int
    free_kv_blocks: int
    total_kv_blocks: int
    draining: bool
    seen: float  # clock() when it arrived

    @property
    def kv_use(self) -> float | None:
        if self.total_kv_blocks <= 0:
            return None
        return (self.total_kv_blocks - self.free_kv_blocks) / self.total_kv_blocks


def instance_of(status: control_pb2.InstanceStatus, now: float) -> Instance | None:
    """The page's view of a heartbeat; None for one with no role or no id."""
    try:
        role = role_of(status)
    except ValueError:
        return None
    if not status.instance_id:
        return None
    return Instance(
        instance_id=status.instance_id,
        role=role,
        model=status.model,
        running=status.running,
        waiting=status.waiting,
        queued_tokens=status.queued_tokens,
        free_kv_blocks=status.free_kv_blocks,
        total_kv_blocks=status.total_kv_blocks,
        draining=status.draining,
        seen=now,
    )


@dataclass(frozen=True)
class Counters:
    """Cumulative counts at one tick. The recipe's own are always known; ``retries`` (the
    entrypoints') and ``degraded_reads`` (the kvstores') are None when none was reached."""

    t: float  # clock() seconds
    requests: float  # HTTP responses, every route and status
    errors: float  # of those, 5xx
    rejected: float  # of those, 429 (key limits, a full encode pool, no capacity)
    prompt_tokens: float
    cached_tokens: float
    retries: float | None = None
    degraded_reads: float | None = None


def _increase(new: float | None, old: float | None) -> float | None:
    """A counter's increase; after a reset (a restarted process) the new value is all of it."""
    if new is None or old is None:
        return None
    return new - old if new >= old else new


def rates(new: Counters, old: Counters) -> dict[str, float | None]:
    """The rates between two ticks: per second, and the cache hit rate (cached / prompt
    tokens of the requests answered meanwhile; None when there were none)."""
    dt = new.t - old.t
    if dt <= 0:
        return {}

    def per_s(n: float | None, o: float | None) -> float | None:
        d = _increase(n, o)
        return None if d is None else d / dt

    prompt = _increase(new.prompt_tokens, old.prompt_tokens) or 0.0
    cached = _increase(new.cached_tokens, old.cached_tokens) or 0.0
    requests = _increase(new.requests, old.requests) or 0.0
    errors = _increase(new.errors, old.errors) or 0.0
    return {
        "hit_rate": min(1.0, cached / prompt) if prompt > 0 else None,
        "requests_per_s": requests / dt,
        "errors_per_s": errors / dt,
        "error_ratio": errors / requests if requests > 0 else None,
        "rejected_per_s": per_s(new.rejected, old.rejected),
        "retries_per_s": per_s(new.retries, old.retries),
        "degraded_reads_per_s": per_s(new.degraded_reads, old.degraded_reads),
    }


HISTORY_SERIES = (
    "hit_rate",
    "requests_per_s",
    "errors_per_s",
    "rejected_per_s",
    "retries_per_s",
)


def bucket_sort_key(bucket: str) -> tuple[int, float, str]:
    """Buckets in length order by their lower bound (``<16K``, ``16K-64K``, ..., ``>=256K``),
    then ``any`` and ``unknown``; the balancer's names (``libs/routing/buckets.py``)."""
    if bucket.startswith("<") or bucket == "all":
        return (0, 0.0, bucket)
    m = re.match(r">?=?(\d+)(K?)", bucket)
    if m:
        return (0, int(m.group(1)) * (1024 if m.group(2) else 1), bucket)
    return (1, 0.0, bucket)


def bucket_map(balancers: Iterable[Scrape]) -> dict[str, str]:
    """Bucket of each prefill instance, by the balancers' gauge. Replicas place instances
    from the demand each saw, so they may differ: a placement wins over ``any``, and two
    replicas that disagree show both (``<16K|16K-64K``)."""
    seen: dict[str, set[str]] = {}
    for b in balancers:
        for labels, value in (b.samples or {}).get("deepserve:balancer_prefill_bucket", []):
            if value > 0 and labels.get("instance"):
                seen.setdefault(labels["instance"], set()).add(labels.get("bucket", ANY_BUCKET))
    out = {}
    for iid, names in seen.items():
        placed = names - {ANY_BUCKET} or names
        out[iid] = "|".join(sorted(placed, key=bucket_sort_key))
    return out


def kvstore_view(scrapes: list[Scrape]) -> dict[str, Any]:
    """The kvstore panel: capacity and use, target health, degraded reads, from every kvstore
    process's ``/metrics`` (they share Redis and targets: sizes are the same store, a target
    counts as down when any process's probe found it down)."""
    up = [s for s in scrapes if s.samples is not None]
    view: dict[str, Any] = {
        "state": "not configured",
        "stored_blocks": None,
        "stored_bytes": None,
        "capacity_bytes": None,
        "use": None,
        "targets": [],
        "degraded_targets": [],
        "lost_blocks": _sum_present(s.total("deepserve:kvstore_lost_blocks_total") for s in up),
    }
    if not scrapes:
        return view
    if not up:
        view["state"] = "unreachable"
        return view

    def most(name: str) -> float | None:
        values = [v for v in (s.total(name) for s in up) if v is not None]
        return max(values) if values else None

    blocks, stored = most("deepserve:kvstore_stored_blocks"), most("deepserve:kvstore_stored_bytes")
    capacity = most("deepserve:kvstore_capacity_bytes")
    targets: dict[str, bool] = {}
    for s in up:
        for labels, value in (s.samples or {}).get("deepserve:kvstore_target_up", []):
            name = labels.get("target", "?")
            targets[name] = targets.get(name, True) and value > 0
    down = sorted(t for t, ok in targets.items() if not ok)
    view.update(
        stored_blocks=blocks,
        stored_bytes=stored,
        capacity_bytes=capacity,
        use=stored / capacity if stored is not None and capacity else None,
        targets=[{"name": t, "up": ok} for t, ok in sorted(targets.items())],
        degraded_targets=down,
    )
    if down or len(up) < len(scrapes) or stored is None:
        # A target down, a kvstore process not answering, or Redis not answering it.
        view["state"] = "degraded"
    else:
        view["state"] = "ok"
    if stored is None:
        view["note"] = "the kvstore does not read its Redis (sizes unknown)"
    return view


class StatusBoard:
    """Heartbeats in (any time), one ``tick`` per collector interval, ``snapshot()`` out.

    ``history_s`` bounds the "over time" series (``history_s / interval`` points); the samples
    kept for rates cover ``RATE_WINDOW_S``. Single-threaded: the collector and the ops server
    share one event loop.
    """

    def __init__(
        self,
        interval: float,
        history_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not interval > 0 or not history_s >= interval:
            raise ValueError(f"need 0 < interval <= history_s, got {interval} / {history_s}")
        self.interval, self.history_s = interval, history_s
        self.clock, self.wall = clock, wall
        self.instances: dict[tuple[str, str], Instance] = {}
        self.loading = LoadTable()
        self._samples: deque[Counters] = deque(maxlen=math.ceil(RATE_WINDOW_S / interval) + 1)
        self._history: deque[dict[str, Any]] = deque(maxlen=math.ceil(history_s / interval))
        self._snapshot: dict[str, Any] = self._build([], [], [], (False, "starting"), {})

    def observe(self, status: control_pb2.InstanceStatus) -> None:
        inst = instance_of(status, self.clock())
        if inst is None:
            return
        key = (inst.role, inst.instance_id)
        if key not in self.instances and len(self.instances) >= MAX_INSTANCES:
            self._forget(self.clock())
            if len(self.instances) >= MAX_INSTANCES:
                return
        self.instances[key] = inst

    def observe_load(self, status: control_pb2.LoadStatus) -> None:
        """An instance's load progress (its row on the page until it has loaded)."""
        self.loading.observe(status, self.clock())

    def _forget(self, now: float) -> None:
        for key in [k for k, i in self.instances.items() if now - i.seen > FORGET_AFTER_S]:
            del self.instances[key]

    def tick(
        self,
        counters: Counters,
        kvstores: list[Scrape],
        balancers: list[Scrape],
        entrypoints: list[Scrape],
        nats: tuple[bool, str],
    ) -> dict[str, Any]:
        """Record one tick's counters and scrapes; the new snapshot."""
        self._forget(counters.t)
        self.loading.forget(self.clock())
        window_start = counters.t - RATE_WINDOW_S - self.interval / 2
        base = next((s for s in self._samples if s.t >= window_start), None)
        self._samples.append(counters)
        now: dict[str, Any] = {}
        if base is not None:
            now = rates(counters, base)
            self._history.append(
                {"t_ms": int(self.wall() * 1000), **{k: now.get(k) for k in HISTORY_SERIES}}
            )
        self._snapshot = self._build(kvstores, balancers, entrypoints, nats, now, counters)
        return self._snapshot

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    def _build(
        self,
        kvstores: list[Scrape],
        balancers: list[Scrape],
        entrypoints: list[Scrape],
        nats: tuple[bool, str],
        now: Mapping[str, Any],
        counters: Counters | None = None,
    ) -> dict[str, Any]:
        buckets = bucket_map(balancers)
        kv = kvstore_view(kvstores)
        kv["degraded_reads_per_s"] = now.get("degraded_reads_per_s")
        hit_total = None
        if counters is not None and counters.prompt_tokens > 0:
            hit_total = counters.cached_tokens / counters.prompt_tokens
        return {
            "version": 1,
            "generated_unix_ms": int(self.wall() * 1000),
            "interval_s": self.interval,
            "rate_window_s": RATE_WINDOW_S,
            "sources": {
                "nats": {"ok": nats[0], "detail": nats[1]},
                "kvstore": [s.source() for s in kvstores],
                "balancer": [s.source() for s in balancers],
                "entrypoint": [s.source() for s in entrypoints],
            },
            "instances": self._instances(buckets, reached=any(b.samples for b in balancers)),
            "loading": self.loading.rows(self.clock()),
            "kvstore": kv,
            "rates": {k: now.get(k) for k in (*HISTORY_SERIES, "error_ratio")},
            "totals": {
                "requests": counters.requests if counters else None,
                "errors": counters.errors if counters else None,
                "rejected": counters.rejected if counters else None,
                "retries": counters.retries if counters else None,
                "hit_rate": hit_total,
            },
            "history": {
                "t_ms": [p["t_ms"] for p in self._history],
                **{k: [p[k] for p in self._history] for k in HISTORY_SERIES},
            },
        }

    def _instances(self, buckets: Mapping[str, str], reached: bool) -> list[dict[str, Any]]:
        now = self.clock()
        rows: list[dict[str, Any]] = []
        for inst in self.instances.values():
            bucket = ""
            if inst.role == "prefill":
                bucket = buckets.get(inst.instance_id, ANY_BUCKET if reached else UNKNOWN_BUCKET)
            age = now - inst.seen
            state = "silent" if age > SILENT_AFTER_S else "draining" if inst.draining else "live"
            kv_use = inst.kv_use
            rows.append(
                {
                    "role": inst.role,
                    "bucket": bucket,
                    "id": inst.instance_id,
                    "model": inst.model,
                    "state": state,
                    "age_s": round(age, 1),
                    "running": inst.running,
                    "waiting": inst.waiting,
                    "queued_tokens": inst.queued_tokens,
                    "kv_used_blocks": inst.total_kv_blocks - inst.free_kv_blocks,
                    "kv_total_blocks": inst.total_kv_blocks,
                    "kv_use": None if kv_use is None else round(kv_use, 4),
                }
            )
        rows.sort(key=lambda r: (r["role"] != "prefill", bucket_sort_key(r["bucket"]), r["id"]))
        return rows
