"""The entrypoint's admission during a serving run (``deepserve bench serve --url ...
--stack-json``): how many requests waited, what held them, for how long, and how busy the
engines were while they did -- whether requests wait only while the engines are busy.

The entrypoint's ``/metrics`` (its ops port in ``stack.json``) is read before and after the
run; the report is the difference:

* ``decisions``: admission results (admitted, queued, refused, unfit, unavailable);
* ``queued_why``: what held each queued request when it began to wait (``behind``,
  ``inflight``, ``prefill_queue``, ``decode_kv``, ``no_instance``);
* ``wait_mean_s``: mean wait of the queued requests that were admitted;
* ``queued_busy``: per role, the busy fractions of the heartbeats whose window lay inside a wait:
  how many, their mean, and the share above :data:`BUSY_FLOOR` (issue 32 asks for requests to
  wait only while the engines are at least that busy).

No service code: only the metric names of ``services/entrypoint/admission.py``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

BUSY_FLOOR = 0.85
_DECISIONS = "deepserve_entrypoint_admission_total"
_WHY = "deepserve_entrypoint_admission_queued_reasons_total"
_WAIT = "deepserve_entrypoint_admission_wait_seconds"
_BUSY = "deepserve_entrypoint_admission_queued_busy_fraction"

Sample = dict[str, float]


def url_from(stack_json: str) -> str | None:
    """The entrypoint's ``/metrics`` URL from a ``deepserve up`` run's ``stack.json``."""
    if not stack_json:
        return None
    port = json.loads(Path(stack_json).read_text()).get("ops_ports", {}).get("entrypoint")
    return f"http://127.0.0.1:{port}/metrics" if port else None


def parse(text: str) -> Sample:
    """The admission series of one scrape, flattened to ``name|label`` keys."""
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            if s.name == _DECISIONS:
                out[f"decision|{labels.get('result', '')}"] += s.value
            elif s.name == _WHY:
                out[f"why|{labels.get('why', '')}"] += s.value
            elif s.name in (f"{_WAIT}_sum", f"{_WAIT}_count") and labels.get("result") == (
                "admitted"
            ):
                out[f"wait{s.name[len(_WAIT) :]}"] += s.value
            elif s.name in (f"{_BUSY}_sum", f"{_BUSY}_count"):
                out[f"busy{s.name[len(_BUSY) :]}|{labels.get('role', '')}"] += s.value
            elif s.name == f"{_BUSY}_bucket" and float(labels.get("le", "nan")) == BUSY_FLOOR:
                out[f"busy_floor|{labels.get('role', '')}"] += s.value
    return dict(out)


def scrape(url: str | None) -> Sample | None:
    if url is None:
        return None
    try:
        return parse(httpx.get(url, timeout=5).text)
    except (httpx.HTTPError, ValueError):
        return None


def report(before: Sample, after: Sample) -> dict[str, Any]:
    """What changed between two scrapes."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def labelled(prefix: str) -> dict[str, int]:
        keys = {k for k in (*before, *after) if k.startswith(prefix + "|")}
        return {k.split("|", 1)[1]: int(delta(k)) for k in sorted(keys) if delta(k)}

    waits = delta("wait_count")
    busy: dict[str, Any] = {}
    for role in sorted({k.split("|", 1)[1] for k in after if k.startswith("busy_count|")}):
        n = delta(f"busy_count|{role}")
        if n > 0:
            busy[role] = {
                "samples": int(n),
                "mean": delta(f"busy_sum|{role}") / n,
                f"over_{BUSY_FLOOR}": 1 - delta(f"busy_floor|{role}") / n,
            }
    return {
        "decisions": labelled("decision"),
        "queued_why": labelled("why"),
        "wait_mean_s": delta("wait_sum") / waits if waits > 0 else None,
        "queued_busy": busy,
    }


def summary_line(view: dict[str, Any]) -> str:
    """One line for the console."""
    why = ", ".join(f"{k} {v}" for k, v in view["queued_why"].items()) or "none"
    wait = view["wait_mean_s"]
    busy = "; ".join(
        f"{role} busy {b['mean']:.2f} mean, {b[f'over_{BUSY_FLOOR}']:.0%} of samples over "
        f"{BUSY_FLOOR}"
        for role, b in view["queued_busy"].items()
    )
    return (
        f"admission: queued {view['decisions'].get('queued', 0)} ({why}), waited "
        f"{'-' if wait is None else f'{wait:.2f}'} s mean"
        + (f"; while waiting: {busy}" if busy else "")
    )
