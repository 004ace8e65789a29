"""A block's shards on its targets: write all, read and rebuild, check and repair. Blocking code
(run in a worker thread); shard I/O fans out over a thread pool, one task per target."""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .ec import Codec, NotEnoughShards, unwrap
from .targets import Target, TargetDown, shard_key

log = logging.getLogger("kvstore.shards")


class BlockUnreadable(RuntimeError):
    """Fewer than ``k`` shards can be read now. ``damaged`` is True when that is because shards
    on healthy targets are missing or fail their checksum (the block is lost), False when
    targets are down (it may come back)."""

    def __init__(self, message: str, damaged: bool) -> None:
        super().__init__(message)
        self.damaged = damaged


@dataclass
class ShardScan:
    """What reading a block's shards found."""

    fragments: dict[int, bytes] = field(default_factory=dict)  # index -> valid fragment
    bad: list[int] = field(default_factory=list)  # missing or failing the CRC on a healthy target
    down: dict[int, str] = field(default_factory=dict)  # index -> target name, unreachable


class ShardIO:
    def __init__(self, targets: list[Target], codec: Codec, workers: int = 24) -> None:
        self.targets = {t.name: t for t in targets}
        self.codec = codec
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-shard")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def target(self, name: str) -> Target:
        t = self.targets.get(name)
        if t is None:
            raise TargetDown(f"target {name} is named in metadata but not configured here")
        return t

    def write(self, hex_: str, data: bytes, placement: list[str]) -> list[tuple[str, str]]:
        """Encode and write every shard; returns the (target, key) pairs written. On any failure
        the shards written so far are removed and the error raised."""
        shards = self.codec.encode(data)
        jobs = [(placement[i], shard_key(hex_, i), s) for i, s in enumerate(shards)]
        futs = [(t, k, self.pool.submit(self.target(t).put, k, s)) for t, k, s in jobs]
        done, error = [], None
        for t, k, f in futs:
            try:
                f.result()
                done.append((t, k))
            except BaseException as exc:  # noqa: BLE001 - re-raised below after cleanup
                error = error or exc
        if error is not None:
            self.remove(done)
            raise error
        return done

    def remove(self, pairs: list[tuple[str, str]]) -> None:
        def rm(t: str, k: str) -> None:
            try:
                self.target(t).delete(k)
            except TargetDown:
                log.warning("cannot remove %s from %s: target down (fsck collects it)", k, t)

        for f in [self.pool.submit(rm, t, k) for t, k in pairs]:
            f.result()

    def scan(self, hex_: str, placement: list[str], indices: list[int]) -> ShardScan:
        out = ShardScan()

        def one(i: int) -> bytes | None:
            return self.target(placement[i]).get(shard_key(hex_, i))

        futs = [(i, self.pool.submit(one, i)) for i in indices]
        for i, f in futs:
            try:
                frag = unwrap(f.result())
            except TargetDown:
                out.down[i] = placement[i]
                continue
            except OSError as exc:
                log.warning("shard %d of %s on %s unreadable: %s", i, hex_, placement[i], exc)
                out.bad.append(i)
                continue
            if frag is None:
                out.bad.append(i)
            else:
                out.fragments[i] = frag
        return out

    def read(self, hex_: str, placement: list[str], checksum: str) -> tuple[bytes, ShardScan]:
        """The block's bytes: data shards first, parity only when a data shard is missing, down or
        damaged. Raises :class:`BlockUnreadable`; never returns bytes whose SHA-256 differs."""
        k = self.codec.k
        scan = self.scan(hex_, placement, list(range(k)))
        if len(scan.fragments) < k:
            more = self.scan(hex_, placement, list(range(k, self.codec.n)))
            scan.fragments.update(more.fragments)
            scan.bad += more.bad
            scan.down.update(more.down)
        try:
            data = self.codec.decode(scan.fragments)
        except NotEnoughShards:
            down = sorted(set(scan.down.values()))
            raise BlockUnreadable(
                f"block {hex_}: only {len(scan.fragments)} of {self.codec.n} shards readable, "
                f"{k} needed ({len(scan.bad)} damaged; targets down: {', '.join(down) or 'none'})",
                damaged=not down,
            ) from None
        if hashlib.sha256(data).hexdigest() != checksum:
            raise BlockUnreadable(
                f"block {hex_}: rebuilt bytes fail the block checksum", damaged=True
            )
        return data, scan

    def repair(self, hex_: str, placement: list[str], scan: ShardScan) -> int:
        """Rewrite the ``bad`` shards from the valid ones; returns how many were rewritten."""
        if not scan.bad:
            return 0
        fragments = dict(scan.fragments)
        if len(fragments) < self.codec.n - len(scan.bad) - len(scan.down):
            more = self.scan(
                hex_,
                placement,
                [i for i in range(self.codec.n) if i not in fragments and i not in scan.bad],
            )
            fragments.update(more.fragments)
        rebuilt = self.codec.rebuild(fragments, sorted(scan.bad))
        for i, shard in rebuilt.items():
            self.target(placement[i]).put(shard_key(hex_, i), shard)
        log.warning("block %s: rewrote shards %s", hex_, sorted(rebuilt))
        return len(rebuilt)
