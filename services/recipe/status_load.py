"""The ``/status`` page's "Loading" rows: engine instances loading their model, from the
``LoadStatus`` messages they publish on ``ds.load.<role>.<instance>`` meanwhile
(``libs/serving/load_report.py``). No I/O here; :class:`~.status.StatusBoard` holds one table.

A row says how far the load has got (shards and bytes of the checkpoint, the read rate, the
time left at that rate), or that it failed and why. A loaded or failed instance sends no more,
so its row stays ``FORGET_AFTER_S`` seconds (the page shows how long the load took), then goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libs.proto.deepserve.v1 import control_pb2

# The same timings as the instance rows (status.py): silent past 3 s, forgotten after 30 s.
SILENT_AFTER_S = 3.0
FORGET_AFTER_S = 30.0
MAX_LOADING = 4096  # bounded whatever arrives on the bus


@dataclass(frozen=True)
class Loading:
    status: control_pb2.LoadStatus
    seen: float  # clock() when it arrived

    def row(self, now: float) -> dict[str, Any]:
        s = self.status
        age = now - self.seen
        state = (
            "failed"
            if s.error
            else "loaded"
            if s.done
            else "silent"
            if age > SILENT_AFTER_S
            else "loading"
        )
        fraction = None
        if s.done:
            fraction = 1.0
        elif s.bytes_total > 0:
            fraction = min(1.0, s.bytes_done / s.bytes_total)
        rate = s.bytes_read / s.seconds if s.seconds > 0 and s.shards_done else None
        eta = None
        if not s.done and s.bytes_done > 0 and s.seconds > 0:
            eta = max(0.0, (s.bytes_total - s.bytes_done) * s.seconds / s.bytes_done)
        return {
            "id": s.instance_id,
            "role": s.role,
            "model": s.model,
            "source": s.source,
            "state": state,
            "age_s": round(age, 1),
            "fraction": None if fraction is None else round(fraction, 4),
            "shards_done": s.shards_done,
            "shards_total": s.shards_total,
            "bytes_done": s.bytes_done,
            "bytes_total": s.bytes_total,
            "bytes_read": s.bytes_read,
            "read_bytes_per_s": None if rate is None else round(rate),
            "eta_s": None if eta is None else round(eta, 1),
            "seconds": round(s.seconds, 1),
            "error": s.error,
        }


class LoadTable:
    """The latest ``LoadStatus`` per (role, instance)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], Loading] = {}

    def observe(self, status: control_pb2.LoadStatus, now: float) -> None:
        if not status.instance_id:
            return
        key = (status.role, status.instance_id)
        if key not in self.entries and len(self.entries) >= MAX_LOADING:
            self.forget(now)
            if len(self.entries) >= MAX_LOADING:
                return
        self.entries[key] = Loading(status, now)

    def forget(self, now: float) -> None:
        for key in [k for k, e in self.entries.items() if now - e.seen > FORGET_AFTER_S]:
            del self.entries[key]

    def rows(self, now: float) -> list[dict[str, Any]]:
        rows = [e.row(now) for e in self.entries.values()]
        return sorted(rows, key=lambda r: (r["role"], r["id"]))
