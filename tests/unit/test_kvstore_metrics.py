"""The kvstore's scrape-time gauges without servers: each target's health from a probe (a
directory whose marker is gone is down), no Redis read at registration, nothing exported for
the store's size when Redis does not answer, and no credential in a ``target`` label."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from services.kvstore.metrics import StoreCollector, StoreMetrics, TargetHealth
from services.kvstore.targets import MARKER, DirTarget, TargetDown


class _S3Like:
    """A target whose name carries a credential (a misconfiguration the label must survive)."""

    name = "s3://admin:hunter2@minio:9000/bucket"

    def get(self, key: str) -> bytes | None:
        raise TargetDown("unreachable")


def _up(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value("deepserve:kvstore_target_up", {"target": name})


async def test_a_target_whose_marker_is_gone_shows_down_then_up_again(tmp_path: Path) -> None:
    targets = [DirTarget(tmp_path / f"ssd{i}") for i in range(3)]
    for t in targets:
        t.prepare()
    health = TargetHealth(targets)
    registry = CollectorRegistry()
    registry.register(StoreCollector(lambda: (7, 700), health, 1000))
    await health.check()
    assert [_up(registry, t.name) for t in targets] == [1, 1, 1]
    (tmp_path / "ssd1" / MARKER).unlink()  # unmounted: the mount point is empty
    await health.check()
    assert [_up(registry, t.name) for t in targets] == [1, 0, 1]
    targets[1].prepare()
    await health.check()
    assert _up(registry, targets[1].name) == 1
    assert registry.get_sample_value("deepserve:kvstore_stored_blocks") == 7
    assert registry.get_sample_value("deepserve:kvstore_stored_bytes") == 700
    assert registry.get_sample_value("deepserve:kvstore_capacity_bytes") == 1000


async def test_no_redis_read_at_registration_and_none_when_redis_is_down() -> None:
    calls: list[int] = []

    def stats() -> tuple[int, int] | None:
        calls.append(1)
        return None

    health = TargetHealth([_S3Like()])  # type: ignore[list-item]
    registry = CollectorRegistry()
    registry.register(StoreCollector(stats, health, 0))
    assert calls == [], "registering must not read Redis"
    await health.check()
    text = generate_latest(registry).decode()
    assert calls == [1]
    assert registry.get_sample_value("deepserve:kvstore_stored_blocks") is None
    assert "hunter2" not in text and "deepserve:kvstore_target_up{" in text
    assert _up(registry, "s3://admin:***@minio:9000/bucket") == 0


def test_counters_are_exported_at_zero_from_the_start() -> None:
    m = StoreMetrics()
    for reason in ("capacity", "ttl", "unreachable"):
        labels = {"reason": reason}
        assert m.registry.get_sample_value("deepserve:kvstore_evictions_total", labels) == 0
    labels = {"source": "get"}
    assert m.registry.get_sample_value("deepserve:kvstore_repaired_shards_total", labels) == 0
    assert m.registry.get_sample_value("deepserve:kvstore_degraded_reads_total") == 0
    assert m.registry.get_sample_value("deepserve:kvstore_lost_blocks_total") == 0
