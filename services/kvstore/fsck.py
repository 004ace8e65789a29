"""``deepserve kvstore fsck [--repair]``: check every block's shards and every target's files.

* **damaged**: a shard of a stored block that is missing or fails its CRC on a target that
  answers. ``--repair`` rebuilds it from the other shards (any 10 of 12 suffice).
* **lost**: a block with fewer than 10 valid shards on answering targets; ``--repair`` removes
  its metadata (it can never be read again) and its remaining shards.
* **orphans**: shards no metadata points at (a put that crashed before its metadata was
  written, a delete that crashed after it), and temporary files. Only files older than
  ``grace`` seconds count, so a put in flight on another kvstore process is left alone;
  ``--repair`` deletes them.
* targets that are down are reported; blocks with shards on them are checked as far as possible
  and never declared lost because of them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

from .shards import BlockUnreadable
from .store import KEY_PREFIX, BlockStore
from .targets import Target, TargetDown, parse_shard_key


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
    pipe = store.redis.pipeline(transaction=False)
    for hx in hexes:
        pipe.hmget(KEY_PREFIX + hx, ["targets", "checksum"])
    placements: dict[str, list[str]] = {}
    for hx, (targets, checksum) in zip(hexes, await store._redis(pipe.execute())):
        if targets is None:
            continue
        placements[hx] = json.loads(targets)
        await asyncio.to_thread(_check_block, store, hx, placements[hx], checksum.decode(), report)
    report.blocks = len(placements)
    if repair and report.lost_blocks:
        await store.delete([bytes.fromhex(hx) for hx in report.lost_blocks])
    await _orphans(store, placements, repair, grace_s, report)
    report.targets_down = sorted(set(report.targets_down))
    return report


def _check_block(
    store: BlockStore, hx: str, placement: list[str], checksum: str, report: FsckReport
) -> None:
    io, k = store.io, store.codec.k
    scan = io.scan(hx, placement, list(range(store.codec.n)))
    report.targets_down += scan.down.values()
    report.damaged_shards += [f"{hx}.{i:02d}@{placement[i]}" for i in scan.bad]
    if len(scan.fragments) < k:
        if not scan.down:
            report.lost_blocks.append(hx)
        return
    data = store.codec.decode(scan.fragments)
    if hashlib.sha256(data).hexdigest() != checksum:  # CRCs passed but the bytes are wrong
        report.lost_blocks.append(hx)
        return
    if not scan.bad:
        report.healthy += 1
    elif report.repair:
        try:
            report.repaired_shards += io.repair(hx, placement, scan)
        except (OSError, BlockUnreadable) as exc:
            report.unfixed.append(f"{hx}: {exc}")


async def _orphans(
    store: BlockStore,
    placements: dict[str, list[str]],
    repair: bool,
    grace_s: float,
    report: FsckReport,
) -> None:
    now = time.time()  # file times are wall-clock times, whatever clock the store runs on
    candidates: list[tuple[str, str, str]] = []  # (target, key, block hex or "")
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
            if parsed is None:
                if key.endswith(".tmp"):
                    candidates.append((target.name, key, ""))
                continue
            hx, i = parsed
            where = placements.get(hx)
            if where is None or i >= len(where) or where[i] != target.name:
                candidates.append((target.name, key, hx))
    # A put may have committed since the block list was read: ask Redis again before deleting.
    hexes = sorted({hx for _, _, hx in candidates if hx})
    live = dict(zip(hexes, await store.present([bytes.fromhex(h) for h in hexes]))) if hexes else {}
    orphans = [(t, k) for t, k, hx in candidates if not hx or hx in placements or not live.get(hx)]
    report.orphans = [f"{t}/{k}" for t, k in orphans]
    if repair and orphans:
        await asyncio.to_thread(store.io.remove, orphans)
        report.removed_orphans = len(orphans)


def _listing(target: Target) -> list[tuple[str, float]]:
    return list(target.keys())
