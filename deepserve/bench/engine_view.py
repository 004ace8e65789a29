"""The engines' own view of a serving run, read from their ``/metrics`` (``deepserve bench serve
--url ... --metrics``): so a slow client-side figure points at its cause.

Each prefill/decode instance's ops port is scraped before and after the run (counters and
histograms: what happened during it, as differences) and every ``interval`` seconds during it
(gauges: requests running and waiting, KV cache use). Per instance the report gives:

* ``steps``, ``step_ms`` (mean engine step), ``batch`` (mean requests per step),
  ``tokens_per_step``: from ``deepserve:engine_step_duration_seconds``,
  ``deepserve:engine_step_batch_size``, ``deepserve:iteration_tokens_total``;
* ``ttft_ms`` (prefill: task taken -> first token; ``ttft_parts_ms``: its intake, waiting and
  prefill parts) and ``itl_ms`` / ``e2e_ms`` (decode):
  engine-side means of the latency histograms; ``ttft_p50_ms`` and ``ttft_parts_p50_ms`` their
  medians, read from the histograms' buckets (a wave of first turns weighs on a mean, not on
  a median);
* ``loop_lag_ms`` (mean) and ``loop_lag_over_50ms`` (share of rounds): how late the instance's
  event loop ran its timer (``deepserve_event_loop_lag_seconds``: tasks in and tokens out wait
  as long);
* ``prefix_hit_rate`` (prompt tokens found in the engine's own cache / looked up),
  ``preemptions``, ``prompt_tokens``, ``generation_tokens``;
* ``running`` / ``waiting`` (mean and max of the samples), ``kv_usage`` and ``busy`` (the
  engine's share of wall time spent stepping; mean and max).

Aggregated instances (one engine, both roles) are read like any other engine.

No engine code here: only the metric names of ``libs/serving/engine_metrics.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

P = "deepserve:"
ENGINE_SERVICES = ("prefill", "decode", "aggregated")
GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "engine_busy_fraction",
)
HISTOGRAMS = (
    "engine_step_duration_seconds",
    "engine_step_batch_size",
    "iteration_tokens_total",
    "time_to_first_token_seconds",
    "ttft_intake_seconds",
    "ttft_waiting_seconds",
    "ttft_prefill_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
)
COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
)

LAG = "deepserve_event_loop_lag_seconds"  # every service's, not an engine metric
LAG_SLOW = "0.05"  # the bucket bound past which a round counts as slow (loop_lag_over_50ms)
QUANTILED = ("time_to_first_token_seconds", "ttft_intake_seconds", "ttft_waiting_seconds",
             "ttft_prefill_seconds")  # fmt: skip

# "name" or "name_sum"/"name_count" -> value, summed over labels; "name_bucket:LE" for the
# histograms whose quantiles the report reads
Sample = dict[str, float]


def parse(text: str) -> Sample:
    """The deepserve engine series of one scrape, summed over their labels (one model per
    instance): gauges and counters by name, histograms as ``<name>_sum`` / ``<name>_count``."""
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        name = family.name
        if name == LAG:
            for s in family.samples:
                if s.name in (f"{LAG}_sum", f"{LAG}_count"):
                    out[s.name] += s.value
                elif s.name == f"{LAG}_bucket" and s.labels.get("le") == LAG_SLOW:
                    out[f"{LAG}_bucket:{LAG_SLOW}"] += s.value
            continue
        if not name.startswith(P):
            continue
        short = name[len(P) :]
        for s in family.samples:
            sample = s.name[len(P) :]
            if short in HISTOGRAMS and sample in (f"{short}_sum", f"{short}_count"):
                out[sample] += s.value
            elif short in QUANTILED and sample == f"{short}_bucket":
                out[f"{sample}:{s.labels['le']}"] += s.value
            elif short in GAUGES and sample == short:
                out[short] += s.value
            elif short in COUNTERS and sample in (short, f"{short}_total"):
                out[short] += s.value
    return dict(out)


@dataclass
class Instance:
    name: str
    url: str  # .../metrics
    before: Sample = field(default_factory=dict)
    after: Sample = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        def delta(key: str) -> float:
            return self.after.get(key, 0.0) - self.before.get(key, 0.0)

        def mean(hist: str, scale: float = 1.0) -> float | None:
            n = delta(f"{hist}_count")
            return None if n <= 0 else scale * delta(f"{hist}_sum") / n

        def median(hist: str) -> float | None:
            """The histogram's median over the run in ms, linear within its bucket."""
            key = f"{hist}_bucket:"
            bounds = sorted(
                (float(k[len(key) :]), delta(k)) for k in self.after if k.startswith(key)
            )
            n = delta(f"{hist}_count")
            lo, below = 0.0, 0.0
            for le, cum in bounds:
                if n > 0 and cum >= n / 2:
                    if le == float("inf"):
                        return lo * 1e3
                    inside = cum - below
                    return 1e3 * (lo + (le - lo) * (n / 2 - below) / inside if inside else le)
                lo, below = le, cum
            return None

        def spread(gauge: str) -> dict[str, float] | None:
            xs = [s[gauge] for s in self.samples if gauge in s]
            return None if not xs else {"mean": sum(xs) / len(xs), "max": max(xs)}

        queries = delta("prefix_cache_queries")
        out: dict[str, Any] = {
            "url": self.url,
            "steps": int(delta("engine_step_duration_seconds_count")),
            "step_ms": mean("engine_step_duration_seconds", 1e3),
            "batch": mean("engine_step_batch_size"),
            "tokens_per_step": mean("iteration_tokens_total"),
            "ttft_ms": mean("time_to_first_token_seconds", 1e3),
            # Its parts (they add up to it): intake, the scheduler's queue, the prompt's steps.
            "ttft_parts_ms": {
                part: mean(f"ttft_{part}_seconds", 1e3) for part in ("intake", "waiting", "prefill")
            },
            "ttft_p50_ms": median("time_to_first_token_seconds"),
            "ttft_parts_p50_ms": {
                part: median(f"ttft_{part}_seconds") for part in ("intake", "waiting", "prefill")
            },
            "loop_lag_ms": mean(LAG, 1e3),
            "loop_lag_over_50ms": (
                None
                if delta(f"{LAG}_count") <= 0
                else 1 - delta(f"{LAG}_bucket:{LAG_SLOW}") / delta(f"{LAG}_count")
            ),
            "itl_ms": mean("inter_token_latency_seconds", 1e3),
            "e2e_ms": mean("e2e_request_latency_seconds", 1e3),
            "prefix_hit_rate": None if queries <= 0 else delta("prefix_cache_hits") / queries,
            "preemptions": int(delta("num_preemptions")),
            "prompt_tokens": int(delta("prompt_tokens")),
            "generation_tokens": int(delta("generation_tokens")),
            "running": spread("num_requests_running"),
            "waiting": spread("num_requests_waiting"),
            "kv_usage": spread("kv_cache_usage_perc"),
            "busy": spread("engine_busy_fraction"),  # share of wall time spent stepping
        }
        return out


class EngineView:
    """Scrapes ``targets`` (name -> ``http://host:port/metrics``) around and during a run."""

    def __init__(self, targets: dict[str, str], interval: float = 0.5) -> None:
        self.instances = [Instance(n, u) for n, u in targets.items()]
        self.interval = interval
        self.errors: list[str] = []

    async def _scrape(self, client: httpx.AsyncClient, inst: Instance) -> Sample | None:
        try:
            resp = await client.get(inst.url, timeout=5.0)
            resp.raise_for_status()
            return parse(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.errors.append(f"{inst.name}: {exc!r}")
            return None

    async def _all(self, client: httpx.AsyncClient) -> list[Sample | None]:
        return list(await asyncio.gather(*(self._scrape(client, i) for i in self.instances)))

    async def start(self) -> None:
        async with httpx.AsyncClient() as client:
            for inst, s in zip(self.instances, await self._all(client), strict=True):
                inst.before = s or {}
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        async with httpx.AsyncClient() as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                for inst, s in zip(self.instances, await self._all(client), strict=True):
                    if s is not None:
                        inst.samples.append(s)
                try:
                    await asyncio.wait_for(
                        self._stop.wait(), max(0.0, self.interval - (time.monotonic() - t0))
                    )
                except TimeoutError:
                    pass

    async def stop(self) -> dict[str, Any]:
        self._stop.set()
        await self._task
        async with httpx.AsyncClient() as client:
            for inst, s in zip(self.instances, await self._all(client), strict=True):
                inst.after = s or {}
        out: dict[str, Any] = {i.name: i.report() for i in self.instances}
        if self.errors:
            out["scrape_errors"] = self.errors[:10]
        return out


def targets_from(spec: str, stack_json: str = "") -> dict[str, str]:
    """``--metrics``: ``NAME=URL,...`` or bare URLs (named by position); ``--stack-json``: the
    prefill/decode instances of a ``deepserve up`` run (its ``stack.json`` ops ports)."""
    out: dict[str, str] = {}
    for i, part in enumerate(p.strip() for p in spec.split(",") if p.strip()):
        name, _, url = part.rpartition("=") if "=" in part.split("://")[0] else ("", "", part)
        out[name or f"engine-{i}"] = url
    if stack_json:
        import json
        from pathlib import Path

        state = json.loads(Path(stack_json).read_text())
        for name, svc in state.get("services", {}).items():
            if svc.get("service") in ENGINE_SERVICES and svc.get("ops_port"):
                out[name] = f"http://127.0.0.1:{svc['ops_port']}/metrics"
    for name, url in out.items():
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--metrics {name}: {url!r} is not an http(s) URL")
    return out


def summary_lines(view: dict[str, Any]) -> list[str]:
    """One line per instance for the console."""

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = []
    for name, r in view.items():
        if name == "scrape_errors":
            continue
        kv, busy = r["kv_usage"], r.get("busy")
        parts = r.get("ttft_parts_ms") or {}
        split = ""
        if all(v is not None for v in parts.values()) and parts:
            split = " (" + " + ".join(f"{k} {v:.0f}" for k, v in parts.items()) + ")"
        lines.append(
            f"{name:12s} steps {r['steps']:6d}  step {f(r['step_ms'], '.1f')} ms  "
            f"batch {f(r['batch'], '.1f')}  ttft {f(r['ttft_ms'], '.1f')} ms{split}, "
            f"p50 {f(r.get('ttft_p50_ms'), '.0f')} ms  "
            f"itl {f(r['itl_ms'], '.1f')} ms  prefix hit {f(r['prefix_hit_rate'], '.2f')}  "
            f"kv max {f(kv and kv['max'], '.2f')}  preempt {r['preemptions']}  "
            f"busy {f(busy and busy['mean'], '.2f')}  loop lag {f(r.get('loop_lag_ms'), '.1f')} ms"
        )
    return lines
