"""Prefill heartbeats carry a bounded summary of the prefixes resident in GPU memory."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from libs.common.hashchain import chain_hashes
from libs.engine.kv.block_manager import BlockManager
from libs.proto.deepserve.v1 import control_pb2
from libs.routing.heartbeat import instance_from_status
from libs.serving.engine_stats import EngineStats, resident_summary
from libs.serving.instance import instance_status


def test_recent_names_lists_released_cached_blocks_most_recent_first() -> None:
    bm = BlockManager(16, 4)
    names = chain_hashes(list(range(24)), 4)  # 6 blocks
    a, b = bm.allocate(3), bm.allocate(3)
    for blk, name in zip(a + b, names):
        bm.register(blk, name)
    bm.release(a)
    bm.release(b)  # b released last: its blocks are the most recent
    got = bm.recent_names(4)
    assert got == [names[3], names[4], names[5], names[0]]  # reverse-release order per request
    assert bm.recent_names(0) == []


def test_summary_is_bounded_and_reaches_the_balancer() -> None:
    bm = BlockManager(64, 4)
    names = chain_hashes(list(range(40)), 4)  # 10 blocks: 4 held by a running request
    held = bm.allocate(4)
    for blk, name in zip(held, names[:4]):
        bm.register(blk, name)
    rest = bm.allocate(6)
    for blk, name in zip(rest, names[4:]):
        bm.register(blk, name)
    bm.release(rest)
    req = SimpleNamespace(block_hashes=names[:4], num_registered=4)
    engine: Any = SimpleNamespace(scheduler=SimpleNamespace(running=[req]), blocks=bm)
    summary = resident_summary(engine, limit=7)
    assert len(summary) == 7 and all(len(d) == 8 for d in summary)
    assert summary[:4] == tuple(n[:8] for n in names[:4])
    stats = EngineStats(running=1, resident_prefixes=summary)
    pre = instance_status(
        stats,
        instance_id="p",
        role=control_pb2.ROLE_PREFILL,
        model="m",
        address="",
        draining=False,
        block_size=4,
    )
    dec = instance_status(
        stats,
        instance_id="d",
        role=control_pb2.ROLE_DECODE,
        model="m",
        address="h:1",
        draining=False,
        block_size=4,
    )
    assert list(pre.resident_prefixes) == list(summary) and not dec.resident_prefixes
    assert instance_from_status(pre).resident_run(names) == 4 + 3  # held, then recent free
