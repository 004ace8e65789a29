"""Usage records over a real nats-server: the recipe's publisher creates the stream and
publishes, the records survive a NATS restart (file storage), a retried publish is stored once,
and ``deepserve usage`` totals and prices them per tenant."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.js.api import StorageType
from prometheus_client import CollectorRegistry, Counter

from deepserve import procs
from deepserve.usage import OFF_PEAK, PEAK
from services.recipe.usage import STREAM, UsagePublisher, UsageRecord

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_790_000_000.0  # a fixed start time, the same for every record


def record(rid: str, tenant: str, prompt: int, cached: int, out: int) -> UsageRecord:
    return UsageRecord(
        request_id=rid,
        tenant=tenant,
        key_id="0badf00d",
        model="deepseek-tiny",
        route="chat_completions",
        status="ok",
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=out,
        started_at=T0,
        finished_at=T0 + 1,
    )


RECORDS = [
    record("r1", "acme", 1_000_000, 900_000, 100_000),
    record("r2", "acme", 500_000, 0, 50_000),
    record("r3", "globex", 2_000_000, 2_000_000, 10_000),
]


async def publish(url: str, records: list[UsageRecord]) -> Counter:
    counter = Counter("usage", "x", ["outcome"], registry=CollectorRegistry())
    pub = UsagePublisher(
        url, "test-usage", STREAM, 100, counter, asyncio.Event(), logging.getLogger("t")
    )
    pub.start()
    for r in records:
        pub.submit(r)
    deadline = time.monotonic() + 20
    while counter.labels("published")._value.get() < len(records):
        assert time.monotonic() < deadline, "records not published"
        await asyncio.sleep(0.05)
    await pub.close(5.0)
    return counter


def usage_cli(url: str, *args: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "deepserve.cli", "usage", "--nats-url", url, "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def cost(price: tuple[float, float, float], rs: list[UsageRecord]) -> float:
    return sum(
        (r.uncached_tokens * price[0] + r.cached_tokens * price[1] + r.completion_tokens * price[2])
        / 1e6
        for r in rs
    )


async def test_records_are_durable_and_totalled(tmp_path: Path) -> None:
    port = procs.free_port()
    url = f"nats://127.0.0.1:{port}"
    data = tmp_path / "nats"
    proc = procs.start_nats(port, data, log=tmp_path / "nats.log")
    try:
        await publish(url, RECORDS)
        await publish(url, RECORDS[:1])  # the same request id again: stored once
        nc = await nats.connect(url)
        info = await nc.jsm().stream_info(STREAM)
        await nc.close()
        assert info.config.storage == StorageType.FILE and info.state.messages == 3
    finally:
        procs.stop(proc)
    proc = procs.start_nats(port, data, log=tmp_path / "nats2.log")  # restarted: still there
    try:
        got = usage_cli(url)
        tenants = got["tenants"]
        assert isinstance(tenants, dict) and set(tenants) == {"acme", "globex"}
        acme = tenants["acme"]
        assert acme["requests"] == 2 and acme["uncached_tokens"] == 600_000
        assert acme["cached_tokens"] == 900_000 and acme["completion_tokens"] == 150_000
        off_peak = (OFF_PEAK.uncached, OFF_PEAK.cached, OFF_PEAK.output)
        assert acme["price_usd"] == pytest.approx(cost(off_peak, RECORDS[:2]))
        # 600k uncached x $0.15 + 900k cached x $0.003 + 150k out x $0.60 = $0.1827
        assert acme["price_usd"] == pytest.approx(0.1827)
        got = usage_cli(url, "--tenant", "globex", "--price", "peak")
        peak = (PEAK.uncached, PEAK.cached, PEAK.output)
        assert set(got["tenants"]) == {"globex"}  # type: ignore[arg-type]
        globex = got["tenants"]["globex"]  # type: ignore[index]
        assert globex["price_usd"] == pytest.approx(cost(peak, RECORDS[2:]))
        got = usage_cli(url, "--price", "1,0,0", "--since", "2099-01-01T00:00:00Z")
        assert got["tenants"] == {}
    finally:
        procs.stop(proc)


def test_price_tables_and_peak_hours() -> None:
    """(No server.) DeepSeek's peak: weekdays 01-04 and 06-10 UTC; weekends off-peak."""
    from datetime import UTC, datetime

    from deepserve.usage import is_peak, parse_price, totals

    def at(day: int, hour: int) -> float:  # 2026-11-02 is a Monday
        return datetime(2026, 11, day, hour, 30, tzinfo=UTC).timestamp()

    assert is_peak(at(2, 1)) and is_peak(at(2, 9)) and is_peak(at(6, 3))
    assert not is_peak(at(2, 4)) and not is_peak(at(2, 10)) and not is_peak(at(2, 0))
    assert not is_peak(at(7, 9))  # Saturday
    assert parse_price("off-peak") == OFF_PEAK and parse_price("peak") == PEAK
    assert parse_price("schedule") is None
    with pytest.raises(ValueError, match="--price"):
        parse_price("cheap")
    rs = [
        dataclasses.replace(RECORDS[1], started_at=at(2, 9)),
        dataclasses.replace(RECORDS[1], started_at=at(7, 9)),
    ]
    got = totals(rs, None)["acme"]
    assert got.price_usd == pytest.approx(PEAK.of(rs[0]) + OFF_PEAK.of(rs[1]))
    assert got.price_usd == pytest.approx(0.21 + 0.105)  # 500k uncached + 50k out: peak is x2
