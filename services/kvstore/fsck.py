"""``deepserve kvstore fsck [--repair]``: check every block's shards and every target's files.

* **damaged**: a shard of a stored block that is missing, fails its CRC, has a damaged
  erasure-code header, or holds wrong bytes behind a valid CRC (it disagrees with the block
  rebuilt from 10 shards that reproduce its SHA-256), on a target that answers. ``--repair``
  rewrites it from the rebuilt block (any 10 good shards of 12 suffice).
* **lost**: a block with fewer than 10 valid shards on answering targets; ``--repair`` removes
  its metadata (it can never be read again) and its remaining shards.
* **orphans**: shards no metadata points at (a put that crashed before its metadata was
  written, a delete that crashed after it, the loser of two concurrent puts of one block, every
  shard after Redis lost its data), and temporary files. Only files older than
  ``grace`` seconds count, so a put in flight on another kvstore process is left alone;
  ``--repair`` deletes them.
* targets that are down are reported; blocks with shards on them are checked as far as possible
  and never declared lost because of them.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

from .scripts import KEY_PREFIX
from .shards import BlockUnreadable
from .store import BlockStore
from .targets import Target, TargetDown, parse_shard_key

_BATCH = 1000  # Redis commands per pipeline


@dataclass
class FsckReport:
    blocks: int = 0
    healthy: int = 0
    damaged_shards: list[str] = field(default_factory=list)  # "<hex>.<i>@<target>"
    repaired_shards: int = 0
    lost_blocks: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)  # "<target>/<key>"
    removed_orphans: int = 0
    targets_down: list[str] = field(default_factory=list)
    unfixed: list[str] = field(default_factory=list)
    repair: bool = False

    @property
    def clean(self) -> bool:
        """Nothing wrong is left (with ``--repair``: everything found was fixed or removed)."""
        if self.targets_down or self.unfixed:
            return False
        if self.repair:
            return True
        return not (self.damaged_shards or self.lost_blocks or self.orphans)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "clean": self.clean}, indent=1)


async def fsck(store: BlockStore, repair: bool = False, grace_s: float = 600.0) -> FsckReport:
    report = FsckReport(repair=repair)
    hexes = await store.block_hexes()
    for i in range(0, len(hexes), _BATCH):
        chunk = hexes[i : i + _BATCH]
        pipe = store.redis.pipeline(transaction=False)
        for hx in chunk:
            pipe.hmget(KEY_PREFIX + hx, ["targets", "checksum", "attempt"])
        for hx, (targets, checksum, attempt) in zip(chunk, await store._redis(pipe.execute())):
            if targets is None:
                continue
            report.blocks += 1
            placement, att = json.loads(targets), (attempt or b"").decode()
            await asyncio.to_thread(
                _check_block, store, hx, placement, checksum.decode(), att, report
            )
    if repair and report.lost_blocks:
        gone = await store.delete([bytes.fromhex(hx) for hx in report.lost_blocks])
        store.metrics.lost_blocks.inc(gone)
    await _orphans(store, repair, grace_s, report)
    report.targets_down = sorted(set(report.targets_down))
    return report


async def collect_orphans(store: BlockStore, grace_s: float) -> FsckReport:
    """Only the orphan part of ``fsck --repair``: list the targets, ask Redis about the blocks
    named there, remove shards no metadata points at that are older than ``grace_s`` (Redis
    lost or flushed, crashed puts, losers of concurrent puts). Reads no shard."""
    report = FsckReport(repair=True)
    await _orphans(store, True, grace_s, report)
    report.targets_down = sorted(set(report.targets_down))
    return report


def _check_block(
    store: BlockStore,
    hx: str,
    placement: list[str],
    checksum: str,
    attempt: str,
    report: FsckReport,
) -> None:
    """Read all ``n`` shards: the block must rebuild from some ``k`` of them (a damaged fragment
    header or wrong bytes behind a valid CRC is one damaged shard), and every shard must match
    the block's encoding."""
    try:
        data, scan = store.io.read(hx, placement, checksum, attempt, full=True)
    except BlockUnreadable as exc:
        if exc.damaged:
            report.lost_blocks.append(hx)
        report.targets_down += exc.down
        return
    report.targets_down += scan.down.values()
    report.damaged_shards += [f"{hx}.{i:02d}@{placement[i]}" for i in sorted(scan.bad)]
    if not scan.bad:
        report.healthy += 1
    elif report.repair:
        try:
            n = store.io.repair(hx, placement, data, scan.bad, attempt)
            report.repaired_shards += n
            store.metrics.repaired_shards.labels("fsck").inc(n)
        except OSError as exc:
            report.unfixed.append(f"{hx}: {exc}")


async def _orphans(store: BlockStore, repair: bool, grace_s: float, report: FsckReport) -> None:
    now = time.time()  # file times are wall-clock times, whatever clock the store runs on
    candidates: list[tuple[str, str, str, str, int]] = []  # (target, key, hex, attempt, index)
    for target in store.targets:
        try:
            listing = await asyncio.to_thread(_listing, target)
        except TargetDown:
            report.targets_down.append(target.name)
            continue
        for key, mtime in listing:
            if now - mtime < grace_s:
                continue
            parsed = parse_shard_key(key)
            if parsed is not None:
                candidates.append((target.name, key, *parsed))
            elif key.endswith(".tmp"):
                candidates.append((target.name, key, "", "", -1))
    # Metadata is read after the listing: a shard listed here that a put commits later is
    # younger than ``grace_s`` (puts take seconds), so it was not listed.
    hexes = sorted({c[2] for c in candidates if c[2]})
    meta: dict[str, tuple[list[str], str]] = {}
    for i in range(0, len(hexes), _BATCH):
        chunk = hexes[i : i + _BATCH]
        pipe = store.redis.pipeline(transaction=False)
        for hx in chunk:
            pipe.hmget(KEY_PREFIX + hx, ["targets", "attempt"])
        for hx, (targets, attempt) in zip(chunk, await store._redis(pipe.execute())):
            if targets is not None:
                meta[hx] = (json.loads(targets), (attempt or b"").decode())
    orphans = []
    for t, key, hx, attempt, i in candidates:
        where = meta.get(hx)
        if where is None or where[1] != attempt or i >= len(where[0]) or where[0][i] != t:
            orphans.append((t, key))
    report.orphans = [f"{t}/{k}" for t, k in orphans]
    if repair and orphans:
        await asyncio.to_thread(store.io.remove, orphans)
        report.removed_orphans = len(orphans)


def _listing(target: Target) -> list[tuple[str, float]]:
    return list(target.keys())
