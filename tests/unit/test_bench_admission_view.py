"""``bench serve --stack-json`` reports the entrypoint's admission over the run: read from the
metrics the entrypoint itself records, so a renamed series shows here as a missing figure."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from deepserve.bench.admission_view import parse, report, summary_line
from libs.gateway.capacity import DECODE, PREFILL, Capacity, Load
from services.entrypoint.admission import AdmissionMetrics


def test_the_report_is_what_the_entrypoint_recorded_during_the_run() -> None:
    now = [0.0]
    m = AdmissionMetrics(Capacity(), clock=lambda: now[0])
    m.on_admission("queued", None, 1, "decode_kv")  # recorded before the run: not counted
    m.on_admission("admitted", 0.1, 0)
    before = parse(generate_latest().decode())
    m.on_admission("queued", None, 1, "decode_kv")
    m.on_admission("queued", None, 2, "behind")
    now[0] = 0.5
    m.on_heartbeat(Load("a", DECODE, busy_fraction=0.2))  # half its window before the wait
    now[0] = 1.0
    m.on_heartbeat(Load("a", DECODE, busy_fraction=0.95))  # a whole window inside the wait
    m.on_heartbeat(Load("a", DECODE, busy_fraction=0.45))
    m.on_heartbeat(Load("a", PREFILL, busy_fraction=0.9))
    m.on_admission("admitted", 1.5, 1)
    m.on_admission("admitted", 0.5, 0)
    m.on_heartbeat(Load("a", DECODE, busy_fraction=0.1))  # nothing waits: not sampled
    view = report(before, parse(generate_latest().decode()))
    assert view["decisions"] == {"admitted": 2, "queued": 2}  # the run's, not the earlier ones
    assert view["queued_why"] == {"behind": 1, "decode_kv": 1}
    assert view["wait_mean_s"] == pytest.approx(1.0)
    assert view["queued_busy"]["decode"] == {
        "samples": 2, "mean": pytest.approx(0.7), "over_0.85": pytest.approx(0.5),
    }  # fmt: skip
    assert view["queued_busy"]["prefill"]["over_0.85"] == pytest.approx(1.0)
    line = summary_line(view)
    assert "queued 2 (behind 1, decode_kv 1)" in line and "waited 1.00 s mean" in line


def test_admission_reads_the_busy_window_engines_report() -> None:
    """Admission takes a heartbeat's busy fraction as covering BUSY_WINDOW_S (a torch-free
    copy of the engine side's constant): the two must agree."""
    from libs.gateway import capacity
    from libs.serving import engine_stats

    assert capacity.BUSY_WINDOW_S == engine_stats.BUSY_WINDOW_S
