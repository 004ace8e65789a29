"""The recipe's ``/status`` aggregation (``services/recipe/status.py``), without I/O:
instances by role and bucket from heartbeats, the kvstore panel from its metrics, rates and
their bounded history from counters; the balancer's per-instance bucket gauge it reads; and
the recipe's own counters as the collector reads them."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from libs.proto.deepserve.v1 import control_pb2
from services.balancer.metrics import BalancerMetrics
from services.recipe.config import build_parser, config_from, parse_addresses
from services.recipe.handlers import Metrics
from services.recipe.status import (
    FORGET_AFTER_S,
    MAX_INSTANCES,
    RATE_WINDOW_S,
    Counters,
    Scrape,
    StatusBoard,
    bucket_map,
    kvstore_view,
    parse_metrics,
)
from services.recipe.status_collect import own_counters

from .test_balancer_policy import FakeClock, decode, prefill
from .test_balancer_routing import make

K = 1024

KVSTORE_METRICS = """\
# TYPE deepserve:kvstore_stored_blocks gauge
deepserve:kvstore_stored_blocks 40
# TYPE deepserve:kvstore_stored_bytes gauge
deepserve:kvstore_stored_bytes 3000
# TYPE deepserve:kvstore_capacity_bytes gauge
deepserve:kvstore_capacity_bytes 12000
# TYPE deepserve:kvstore_target_up gauge
deepserve:kvstore_target_up{target="/d/t00"} 1
deepserve:kvstore_target_up{target="/d/t01"} %s
# TYPE deepserve:kvstore_degraded_reads counter
deepserve:kvstore_degraded_reads_total %s
# TYPE deepserve:kvstore_lost_blocks counter
deepserve:kvstore_lost_blocks_total 0
"""


def kv_scrape(address: str = "kv:1", t01_up: int = 1, degraded: int = 0) -> Scrape:
    return Scrape(address, parse_metrics(KVSTORE_METRICS % (t01_up, degraded)))


def heartbeat(iid: str, role: int, **kw: object) -> control_pb2.InstanceStatus:
    return control_pb2.InstanceStatus(instance_id=iid, role=role, model="m", **kw)  # type: ignore[arg-type]


def balancer_scrape(placed: dict[str, str]) -> Scrape:
    lines = ["# TYPE deepserve:balancer_prefill_bucket gauge"]
    lines += [
        f'deepserve:balancer_prefill_bucket{{bucket="{b}",instance="{i}"}} 1'
        for i, b in placed.items()
    ]
    return Scrape("bal:1", parse_metrics("\n".join(lines) + "\n"))


def counters(t: float, **kw: float | None) -> Counters:
    base: dict[str, float | None] = dict(
        requests=0, errors=0, rejected=0, prompt_tokens=0, cached_tokens=0, retries=0
    )
    base.update(kw)
    return Counters(t=t, **base)  # type: ignore[arg-type]


def test_instances_by_role_and_bucket_with_load_and_kv_use() -> None:
    clock = FakeClock()
    board = StatusBoard(2.0, clock=clock)
    board.observe(heartbeat("p-long", control_pb2.ROLE_PREFILL, queued_tokens=70_000, waiting=2))
    board.observe(heartbeat("p-short", control_pb2.ROLE_PREFILL, running=1, queued_tokens=500))
    board.observe(
        heartbeat("d1", control_pb2.ROLE_DECODE, running=7, free_kv_blocks=25, total_kv_blocks=100)
    )
    board.observe(heartbeat("", control_pb2.ROLE_DECODE))  # no id: ignored
    board.observe(heartbeat("x", control_pb2.ROLE_UNSPECIFIED))  # no role: ignored
    snap = board.tick(
        counters(clock.now),
        [],
        [balancer_scrape({"p-long": "64K-256K", "p-short": "<16K"})],
        [],
        (True, "ok"),
    )
    rows = [(r["role"], r["bucket"], r["id"]) for r in snap["instances"]]
    assert rows == [
        ("prefill", "<16K", "p-short"),
        ("prefill", "64K-256K", "p-long"),
        ("decode", "", "d1"),
    ], "prefill first, buckets in length order, decode unbucketed"
    d1 = snap["instances"][2]
    assert (d1["running"], d1["kv_used_blocks"], d1["kv_total_blocks"], d1["kv_use"]) == (
        7,
        75,
        100,
        0.75,
    )
    assert snap["instances"][1]["queued_tokens"] == 70_000
    assert snap["instances"][0]["kv_use"] is None, "no KV numbers in the heartbeat: unknown"
    # Without a balancer reached the bucket is unknown, not a guess.
    snap = board.tick(counters(clock.now), [], [Scrape("bal:1", None, "down")], [], (True, ""))
    assert {r["bucket"] for r in snap["instances"] if r["role"] == "prefill"} == {"unknown"}
    assert snap["sources"]["balancer"] == [{"address": "bal:1", "ok": False, "error": "down"}]


def test_silent_instances_are_marked_then_forgotten() -> None:
    clock = FakeClock()
    board = StatusBoard(1.0, clock=clock)
    board.observe(heartbeat("d1", control_pb2.ROLE_DECODE))
    board.observe(heartbeat("d2", control_pb2.ROLE_DECODE, draining=True))
    clock.now += 4
    board.observe(heartbeat("d2", control_pb2.ROLE_DECODE, draining=True))
    snap = board.tick(counters(clock.now), [], [], [], (True, ""))
    assert {r["id"]: r["state"] for r in snap["instances"]} == {"d1": "silent", "d2": "draining"}
    clock.now += FORGET_AFTER_S
    board.observe(heartbeat("d2", control_pb2.ROLE_DECODE))
    snap = board.tick(counters(clock.now), [], [], [], (True, ""))
    assert [(r["id"], r["state"]) for r in snap["instances"]] == [("d2", "live")]


def test_the_instance_table_is_bounded() -> None:
    clock = FakeClock()
    board = StatusBoard(1.0, clock=clock)
    for i in range(MAX_INSTANCES + 50):
        board.observe(heartbeat(f"d{i}", control_pb2.ROLE_DECODE))
    assert len(board.instances) == MAX_INSTANCES
    clock.now += FORGET_AFTER_S + 1
    board.observe(heartbeat("late", control_pb2.ROLE_DECODE))  # room made from the silent ones
    assert list(board.instances) == [("decode", "late")]


def test_rates_over_the_window_and_a_bounded_history() -> None:
    clock = FakeClock()
    board = StatusBoard(2.0, history_s=20.0, clock=clock, wall=lambda: 1000.0)
    snap = board.tick(counters(clock.now), [], [], [], (True, ""))
    assert snap["history"]["t_ms"] == [] and snap["rates"]["hit_rate"] is None
    assert snap["totals"]["hit_rate"] is None, "no prompt yet"
    clock.now += 2
    snap = board.tick(
        counters(
            clock.now,
            requests=10,
            errors=2,
            rejected=1,
            prompt_tokens=1000,
            cached_tokens=750,
            retries=4,
        ),
        [],
        [],
        [],
        (True, ""),
    )
    r = snap["rates"]
    assert r["hit_rate"] == 0.75 and r["requests_per_s"] == 5.0 and r["errors_per_s"] == 1.0
    assert (r["error_ratio"], r["rejected_per_s"], r["retries_per_s"]) == (0.2, 0.5, 2.0)
    assert snap["totals"] == {
        "requests": 10,
        "errors": 2,
        "rejected": 1,
        "retries": 4,
        "hit_rate": 0.75,
    }
    assert snap["history"]["hit_rate"] == [0.75]
    # Rates reach back over the window only: older traffic no longer counts.
    for _ in range(math.ceil(RATE_WINDOW_S / 2) + 9):
        clock.now += 2
        snap = board.tick(
            counters(
                clock.now,
                requests=10,
                errors=2,
                rejected=1,
                prompt_tokens=1000,
                cached_tokens=750,
                retries=None,  # the entrypoint not reached: unknown, not zero
            ),
            [],
            [],
            [],
            (True, ""),
        )
    r = snap["rates"]
    assert r["hit_rate"] is None, "no prompts in the window: no hit rate"
    assert (r["requests_per_s"], r["errors_per_s"], r["retries_per_s"]) == (0.0, 0.0, None)
    history = snap["history"]
    assert len(history["t_ms"]) == 10, "20 s of 2 s points, the oldest dropped"
    assert all(len(history[k]) == 10 for k in history)
    assert history["hit_rate"] == [None] * 10 and history["retries_per_s"] == [None] * 10


def test_a_restarted_process_counts_as_a_counter_reset() -> None:
    clock = FakeClock()
    board = StatusBoard(1.0, clock=clock)
    board.tick(counters(clock.now, retries=50), [], [], [], (True, ""))
    clock.now += 1
    snap = board.tick(counters(clock.now, retries=3), [], [], [], (True, ""))
    assert snap["rates"]["retries_per_s"] == 3.0, "3 since the restart, not -47"


def test_kvstore_panel_states() -> None:
    assert kvstore_view([])["state"] == "not configured"
    ok = kvstore_view([kv_scrape()])
    assert ok["state"] == "ok"
    assert (ok["stored_blocks"], ok["stored_bytes"], ok["capacity_bytes"], ok["use"]) == (
        40,
        3000,
        12000,
        0.25,
    )
    assert ok["targets"] == [{"name": "/d/t00", "up": True}, {"name": "/d/t01", "up": True}]
    assert ok["degraded_targets"] == []
    # Two kvstore processes share the targets: one that finds a target down marks it down.
    down = kvstore_view([kv_scrape("kv:1"), kv_scrape("kv:2", t01_up=0)])
    assert down["state"] == "degraded" and down["degraded_targets"] == ["/d/t01"]
    half = kvstore_view([kv_scrape("kv:1"), Scrape("kv:2", None, "unreachable: refused")])
    assert half["state"] == "degraded" and half["stored_bytes"] == 3000
    gone = kvstore_view([Scrape("kv:1", None, "unreachable: refused")])
    assert gone["state"] == "unreachable" and gone["stored_bytes"] is None
    no_redis = parse_metrics(
        "# TYPE deepserve:kvstore_capacity_bytes gauge\ndeepserve:kvstore_capacity_bytes 0\n"
    )
    view = kvstore_view([Scrape("kv:1", no_redis)])
    assert view["state"] == "degraded" and "Redis" in view["note"]


def test_degraded_reads_rate_in_the_kvstore_panel() -> None:
    clock = FakeClock()
    board = StatusBoard(1.0, clock=clock)
    kv = kv_scrape(degraded=5)
    board.tick(
        counters(clock.now, degraded_reads=kv.counter("deepserve:kvstore_degraded_reads_total")),
        [kv],
        [],
        [],
        (True, ""),
    )
    clock.now += 2
    kv = kv_scrape(degraded=9)
    snap = board.tick(
        counters(clock.now, degraded_reads=kv.counter("deepserve:kvstore_degraded_reads_total")),
        [kv],
        [],
        [],
        (True, ""),
    )
    assert snap["kvstore"]["degraded_reads_per_s"] == 2.0
    assert snap["kvstore"]["state"] == "ok"
    assert snap["sources"]["kvstore"] == [{"address": "kv:1", "ok": True, "error": ""}]


def test_bucket_map_merges_balancer_replicas() -> None:
    a = balancer_scrape({"p1": "<16K", "p2": "any", "p3": "16K-64K"})
    b = balancer_scrape({"p1": "<16K", "p2": ">=256K", "p3": "<16K"})
    assert bucket_map([a, b, Scrape("bal:2", None, "down")]) == {
        "p1": "<16K",
        "p2": ">=256K",  # a placement beats "not placed yet"
        "p3": "<16K|16K-64K",  # replicas that disagree: both shown
    }


def test_the_balancer_exports_each_prefill_instances_bucket() -> None:
    clock = FakeClock()
    p = make(clock, prefill("p1"), prefill("p2"), decode("d1"))
    registry = CollectorRegistry()
    BalancerMetrics(registry, p)

    def placed() -> dict[str, str]:
        return bucket_map([Scrape("b", parse_metrics(_exposition(registry)))])

    assert placed() == {"p1": "any", "p2": "any"}, "nothing routed: no assignment yet"
    assert p._assigned == {}, "a scrape computes no assignment"
    p.route(model="m", request_id="s", prompt_tokens=1000)
    p.route(model="m", request_id="l", prompt_tokens=100 * K)
    clock.now += p.rebalance_interval
    for inst in (prefill("p1"), prefill("p2"), decode("d1")):
        p.observe(inst)
    p.route(model="m", request_id="l2", prompt_tokens=100 * K)
    assert placed() == {"p1": "<16K", "p2": "64K-256K"}
    clock.now += 10  # every heartbeat is old: nobody is live
    assert placed() == {}


def _exposition(registry: CollectorRegistry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def test_own_counters_sum_over_tenants_and_routes() -> None:
    m = Metrics(CollectorRegistry())
    m.requests.labels("chat", "200", "aaaa1111").inc(5)
    m.requests.labels("messages", "200", "bbbb2222").inc(2)
    m.requests.labels("chat", "502", "aaaa1111").inc(1)
    m.requests.labels("chat", "504", "-").inc(1)
    m.requests.labels("chat", "429", "bbbb2222").inc(3)
    m.requests.labels("chat", "400", "-").inc(4)
    m.tokens.labels("prompt", "aaaa1111").inc(1000)
    m.tokens.labels("prompt", "bbbb2222").inc(500)
    m.tokens.labels("cached", "aaaa1111").inc(640)
    m.tokens.labels("completion", "aaaa1111").inc(77)
    c = own_counters(m, 12.5)
    assert (c.t, c.requests, c.errors, c.rejected) == (12.5, 16, 2, 3)
    assert (c.prompt_tokens, c.cached_tokens) == (1500, 640)


def test_status_flags() -> None:
    cfg = config_from(
        build_parser().parse_args(
            [
                "--kvstore-ops-address",
                "10.0.0.5:9100, 10.0.0.6:9100",
                "--balancer-ops-address",
                "bal:9101",
                "--status-interval",
                "0.5",
            ]
        )
    )
    assert cfg.status.kvstores == ("10.0.0.5:9100", "10.0.0.6:9100")
    assert (cfg.status.balancers, cfg.status.entrypoints) == (("bal:9101",), ())
    assert cfg.status.interval == 0.5
    assert parse_addresses("--x", "") == ()
    for bad in ("nohost", ":9100", "host:", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="--kvstore-ops-address"):
            parse_addresses("--kvstore-ops-address", bad)
    with pytest.raises(ValueError, match="--status-interval"):
        config_from(build_parser().parse_args(["--status-interval", "0"]))
