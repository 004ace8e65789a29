"""Engine metrics of a prefill or decode instance, named and typed as vLLM's (``vllm:`` ->
``deepserve:``), each with a ``model_name`` label, on the service's ops port (``/metrics``).

Where each value comes from -- the engine's own state, never an estimate:

* gauges ``deepserve:num_requests_running`` / ``_waiting`` (the scheduler's queues) and
  ``deepserve:kv_cache_usage_perc`` (blocks not free / all blocks, 0..1),
  ``deepserve:engine_busy_fraction`` (share of the last 1 s of wall time the engine spent
  stepping, 0..1; deepserve's own, vLLM has none), and counters
  ``deepserve:num_preemptions_total``, ``deepserve:prefix_cache_queries_total`` /
  ``_hits_total`` (prompt tokens looked up in / found in this engine's own prefix cache), and
  with speculative decoding ``deepserve:spec_decode_num_drafts_total`` (requests whose drafts a
  step verified), ``_num_draft_tokens_total`` (drafts verified), ``_num_accepted_tokens_total``
  and ``_num_drafted_tokens_total`` (drafts made, verified or not; the confidence schedule
  skips some): read at scrape time from the engine thread's latest
  :class:`~.engine_loop.EngineStats` snapshot (replaced after every engine iteration);
* histograms ``deepserve:engine_step_duration_seconds``, ``deepserve:engine_step_batch_size``
  (requests in the step) and ``deepserve:iteration_tokens_total`` (tokens in the step):
  observed on the engine thread once per step whose results came back (the engine's own
  timing of that step, ``Engine.last_step_seconds``);
* per request, from the events as the engine loop hands them to the service (asyncio thread):
  prefill: ``deepserve:time_to_first_token_seconds`` (arrival -> first token; the arrival is
  what the service passes to ``EngineLoop.add``: prefill, the task taken, before any kvstore
  load; decode, the KV push taken, before its upload) and ``deepserve:prompt_tokens_total``;
  the same interval in three parts that add up to it, deepserve's own:
  ``deepserve:ttft_intake_seconds`` (arrival -> the engine thread took the request: kvstore
  load, KV upload, commands queued ahead of it), ``deepserve:ttft_waiting_seconds`` (taken ->
  a step first computed any of it: the scheduler's queue) and
  ``deepserve:ttft_prefill_seconds`` (-> its first token reached the service: the steps of
  its prompt chunks and the hand-back of the last one's result);
  decode: ``deepserve:inter_token_latency_seconds`` (between two engine steps that gave the
  request tokens) and ``deepserve:e2e_request_latency_seconds`` (arrival -> the finishing
  token; aborted requests are not observed); both:
  ``deepserve:generation_tokens_total`` (prefill's first tokens plus decode's rest: the sum over
  instances is what was generated; a prompt is counted once, where it was computed).

Not thread-safe by itself: ``on_add`` / ``on_events`` / ``on_drop`` run on the asyncio thread,
``on_step`` on the engine thread; prometheus_client's objects lock internally.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.engine.scheduler import TokenEvent

from .engine_stats import EngineStats

PREFIX = "deepserve:"
PREFILL, DECODE = "prefill", "decode"
LABELS = ("model_name",)
_C = TypeVar("_C", bound=Collector)

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for it read these alike.
TTFT_BUCKETS: tuple[float, ...] = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5),
    *(5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS: tuple[float, ...] = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0, 20.0, 40.0, 80.0),
)
E2E_BUCKETS: tuple[float, ...] = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0),
    *(60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
# The parts of time to first token, in order (they add up to it).
TTFT_PHASES = (
    ("intake", "arrival -> the engine took the request (kvstore load, commands ahead of it)"),
    ("waiting", "taken -> a step first computed any of it (the scheduler's queue)"),
    ("prefill", "first computed -> its first token reached the service"),
)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class _Timing:
    """One request in flight: when it was added, when it last got a token."""

    added: float
    prompt_tokens: int
    last_token: float | None = None


class EngineMetrics:
    """The series of one engine instance (``role``: prefill or decode; anything else
    observes everything -- a test's engine). ``registry``: where they are registered
    (tests pass their own); :meth:`unregister` takes them out again."""

    def __init__(self, model_name: str, role: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.model_name, self.role, self.registry = model_name, role, registry
        self._stats: Callable[[], EngineStats] = EngineStats
        self._timings: dict[str, _Timing] = {}
        self._last_step = 0  # Engine.finished_steps at the last on_step
        # Running totals for the periodic stats line (asyncio thread).
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._ttft: Histogram | None = None
        self._itl: Histogram | None = None
        self._e2e: Histogram | None = None
        self._prompt: Counter | None = None
        self._phases: tuple[Histogram, Histogram, Histogram] | None = None
        self._registered: list[Collector] = []
        if role != DECODE:
            self._ttft = self._add(
                Histogram(
                    PREFIX + "time_to_first_token_seconds",
                    "Time to first token: request added to the engine -> its first token",
                    LABELS,
                    registry=None,
                    buckets=TTFT_BUCKETS,
                )
            )
            self._prompt = self._add(
                Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", LABELS, registry=None)
            )
            self._phases = tuple(  # type: ignore[assignment]
                self._add(
                    Histogram(
                        PREFIX + f"ttft_{name}_seconds",
                        f"Time to first token, in part: {help_}",
                        LABELS,
                        registry=None,
                        buckets=TTFT_BUCKETS,
                    )
                )
                for name, help_ in TTFT_PHASES
            )
        if role != PREFILL:
            self._itl = self._add(
                Histogram(
                    PREFIX + "inter_token_latency_seconds",
                    "Time between two engine steps that gave a request tokens",
                    LABELS,
                    registry=None,
                    buckets=ITL_BUCKETS,
                )
            )
            self._e2e = self._add(
                Histogram(
                    PREFIX + "e2e_request_latency_seconds",
                    "Request added to the engine -> its last token (finished, not aborted)",
                    LABELS,
                    registry=None,
                    buckets=E2E_BUCKETS,
                )
            )
        self._gen = self._add(
            Counter(PREFIX + "generation_tokens", "Tokens generated", LABELS, registry=None)
        )
        self._step_s = self._add(
            Histogram(
                PREFIX + "engine_step_duration_seconds",
                "Wall time of one engine step (schedule, forward, sample)",
                LABELS,
                registry=None,
                buckets=STEP_BUCKETS,
            )
        )
        self._batch = self._add(
            Histogram(
                PREFIX + "engine_step_batch_size",
                "Requests computed in one engine step",
                LABELS,
                registry=None,
                buckets=BATCH_BUCKETS,
            )
        )
        self._step_tokens = self._add(
            Histogram(
                PREFIX + "iteration_tokens_total",
                "Tokens computed in one engine step",
                LABELS,
                registry=None,
                buckets=TOKEN_BUCKETS,
            )
        )
        self._add(_StateCollector(self))

    def _add(self, collector: _C) -> _C:
        """Register ``collector``; a labelled metric comes back as its one child for this
        model, created now so that every series is exported (at 0) from the start. A name
        the registry holds already (a second engine in this process): ValueError, with
        nothing of this object left registered."""
        try:
            self.registry.register(collector)
        except ValueError:
            self.unregister()
            raise
        self._registered.append(collector)
        if isinstance(collector, (Counter, Histogram)):
            return collector.labels(self.model_name)  # type: ignore[return-value]
        return collector

    def unregister(self) -> None:
        for collector in self._registered:
            self.registry.unregister(collector)
        self._registered.clear()

    def attach(self, stats: Callable[[], EngineStats]) -> None:
        """Where the gauges read the engine's state: the loop's latest snapshot."""
        self._stats = stats

    def state(self) -> EngineStats:
        return self._stats()

    # -- engine thread ------------------------------------------------------------------------
    def on_step(self, finished_steps: int, seconds: float, seqs: int, tokens: int) -> None:
        """After an engine iteration: observe the step that finished in it, if one did."""
        if finished_steps == self._last_step:
            return  # an overlapped engine's first launch: nothing came back yet
        self._last_step = finished_steps
        self._step_s.observe(seconds)
        self._batch.observe(seqs)
        self._step_tokens.observe(tokens)

    # -- asyncio thread -----------------------------------------------------------------------
    def on_add(self, request_id: str, prompt_tokens: int, arrival: float | None = None) -> None:
        """``arrival``: monotonic time the request reached the instance (None: now)."""
        added = time.monotonic() if arrival is None else arrival
        self._timings[request_id] = _Timing(added, prompt_tokens)

    def on_drop(self, request_id: str) -> None:
        """The request will produce no more events (refused, or its engine failed)."""
        self._timings.pop(request_id, None)

    def on_events(self, events: Iterable[TokenEvent]) -> None:
        """One engine step's events, as delivered: several events of one request in one step
        (speculative tokens) are one inter-token interval."""
        now = time.monotonic()
        seen: set[str] = set()
        for ev in events:
            t = self._timings.get(ev.request_id)
            if t is None:
                continue
            if ev.token_id is not None:
                self.generation_tokens += 1
                self._gen.inc()
                if t.last_token is None:
                    self._first_token(t, now, ev.timing)
                elif ev.request_id not in seen and self._itl is not None:
                    self._itl.observe(now - t.last_token)
                seen.add(ev.request_id)
                t.last_token = now
            if ev.finished:
                del self._timings[ev.request_id]
                if ev.finish_reason != "abort" and self._e2e is not None:
                    self._e2e.observe(now - t.added)

    def _first_token(self, t: _Timing, now: float, timing: tuple[float, float] | None) -> None:
        if self._ttft is not None and self._prompt is not None:
            self._ttft.observe(now - t.added)
            if timing is not None and self._phases is not None:
                taken, scheduled = timing
                # Clamped into [added, now]: a request taken before its arrival was stamped
                # (a caller's own arrival time) still splits the same total.
                taken = min(max(taken, t.added), now)
                scheduled = min(max(scheduled, taken), now)
                for h, v in zip(
                    self._phases, (taken - t.added, scheduled - taken, now - scheduled), strict=True
                ):
                    h.observe(v)
            self._prompt.inc(t.prompt_tokens)
            self.prompt_tokens += t.prompt_tokens


class _StateCollector(Collector):
    """Gauges and the engine's own counters, from the latest snapshot at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s, name = self._m.state(), [self._m.model_name]
        for family, metric, help_, value in (
            (
                GaugeMetricFamily,
                "num_requests_running",
                "Requests in the engine's batch",
                s.running,
            ),
            (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to run", s.waiting),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "KV cache usage: blocks held by requests / all blocks (1 = full)",
                s.kv_cache_usage,
            ),
            (
                GaugeMetricFamily,
                "engine_busy_fraction",
                "Share of the last 1 s of wall time the engine spent stepping (1 = never idle)",
                s.busy_fraction,
            ),
            (CounterMetricFamily, "num_preemptions", "Requests preempted", s.num_preemptions),
            (
                CounterMetricFamily,
                "prefix_cache_queries",
                "Prompt tokens looked up in the engine's prefix cache",
                s.prefix_cache_queries,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_hits",
                "Prompt tokens found in the engine's prefix cache",
                s.prefix_cache_hits,
            ),
            (
                CounterMetricFamily,
                "spec_decode_num_drafts",
                "Speculative decoding: requests whose drafts a step verified (per request, step)",
                s.spec_verifications,
            ),
            (
                CounterMetricFamily,
                "spec_decode_num_draft_tokens",
                "Speculative decoding: draft tokens verified",
                s.spec_verified,
            ),
            (
                CounterMetricFamily,
                "spec_decode_num_accepted_tokens",
                "Speculative decoding: draft tokens accepted",
                s.spec_accepted,
            ),
            (
                CounterMetricFamily,
                "spec_decode_num_drafted_tokens",
                "Speculative decoding: draft tokens the MTP head made (verified or not)",
                s.spec_drafted,
            ),
        ):
            m = family(PREFIX + metric, help_, labels=LABELS)
            m.add_metric(name, value)
            yield m


class StatsLine:
    """The periodic per-instance stats line: load now, tokens/s since the previous line."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self._at = time.monotonic()
        self._prompt = metrics.prompt_tokens
        self._gen = metrics.generation_tokens

    def line(self) -> str:
        m, s, now = self.metrics, self.metrics.state(), time.monotonic()
        dt = max(now - self._at, 1e-9)
        prompt_rate = (m.prompt_tokens - self._prompt) / dt
        gen_rate = (m.generation_tokens - self._gen) / dt
        self._at, self._prompt, self._gen = now, m.prompt_tokens, m.generation_tokens
        hit = 100 * s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0
        prompt = "" if m.role == DECODE else f"prompt_tokens/s={prompt_rate:.1f} "
        return (
            f"engine stats: running={s.running} waiting={s.waiting} "
            f"kv_usage={100 * s.kv_cache_usage:.1f}% {prompt}"
            f"generation_tokens/s={gen_rate:.1f} prefix_cache_hit={hit:.1f}% "
            f"preemptions={s.num_preemptions}"
        )


async def log_stats(
    metrics: EngineMetrics, interval_s: float, log: logging.Logger, stop: asyncio.Event
) -> None:
    """One :class:`StatsLine` every ``interval_s`` seconds until ``stop`` is set."""
    stats = StatsLine(metrics)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            log.info(stats.line())
