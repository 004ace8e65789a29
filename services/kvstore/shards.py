"""A block's shards on its targets: write all, read and rebuild, check and repair. Blocking code
(run in a worker thread); shard I/O fans out over a thread pool, one task per target."""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import combinations

from .ec import HEAD_SIZE as _HEAD_SIZE
from .ec import BadFragments, Codec, Fragment, unwrap
from .targets import Target, TargetDown, shard_key

log = logging.getLogger("kvstore.shards")


class BlockUnreadable(RuntimeError):
    """Fewer than ``k`` shards can be read now. ``damaged`` is True when that is because shards
    on healthy targets are missing or fail their checksum (the block is lost), False when
    targets are down (it may come back)."""

    def __init__(self, message: str, damaged: bool, down: list[str] | None = None) -> None:
        super().__init__(message)
        self.damaged = damaged
        self.down = down or []  # names of the targets that are down


@dataclass
class ShardScan:
    """What reading a block's shards found."""

    fragments: dict[int, Fragment] = field(default_factory=dict)  # index -> valid fragment
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

    def write(
        self, hex_: str, data: bytes, placement: list[str], attempt: str
    ) -> list[tuple[str, str]]:
        """Encode and write every shard under this put attempt's names; returns the (target,
        key) pairs written. On any failure the shards written so far are removed and the error
        raised."""
        shards = self.codec.encode(data)
        jobs = [(placement[i], shard_key(hex_, i, attempt), s) for i, s in enumerate(shards)]
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

    def scan(self, hex_: str, placement: list[str], indices: list[int], attempt: str) -> ShardScan:
        """Read shards ``indices``; a shard missing, failing its CRC or whose fragment header is
        damaged or names another index is ``bad``."""
        out = ShardScan()

        def one(i: int) -> Fragment | None:  # the CRC too: the pool's threads check in parallel
            frag = unwrap(self.target(placement[i]).get(shard_key(hex_, i, attempt)))
            return frag if frag is not None and self.codec.fragment_ok(i, frag) else None

        futs = [(i, self.pool.submit(one, i)) for i in indices]
        for i, f in futs:
            try:
                frag = f.result()
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

    def read(
        self, hex_: str, placement: list[str], checksum: str, attempt: str, full: bool = False
    ) -> tuple[bytes, ShardScan]:
        """The block's bytes: data shards first, parity only when a data shard is missing, down,
        damaged, or the block's SHA-256 says one of them holds wrong bytes behind a valid CRC;
        then any ``k`` shards that reproduce the SHA-256 win, and the shards that disagree with
        them join ``scan.bad`` (to be rewritten). ``full`` reads and checks all ``n`` (fsck).

        Raises :class:`BlockUnreadable`; never returns bytes whose SHA-256 differs."""
        k, n = self.codec.k, self.codec.n
        scan = self.scan(hex_, placement, list(range(n if full else k)), attempt)
        first = tuple(sorted(scan.fragments)[:k])
        data = self._decode(scan.fragments, first, checksum) if len(first) == k else None
        used = first
        if data is None:
            if not full:
                more = self.scan(hex_, placement, list(range(k, n)), attempt)
                scan.fragments.update(more.fragments)
                scan.bad += more.bad
                scan.down.update(more.down)
            found = self._search(scan.fragments, checksum, skip=first)
            if found is None:
                raise self._unreadable(hex_, scan)
            data, used = found
        others = [i for i in scan.fragments if i not in used]
        if others:  # shards read but not used: right only if they match a fresh encoding
            shards = self.codec.encode(data)
            for i in others:
                if shards[i][_HEAD_SIZE:] != scan.fragments[i]:
                    del scan.fragments[i]
                    scan.bad.append(i)
        return data, scan

    def _decode(
        self, fragments: dict[int, Fragment], use: tuple[int, ...], checksum: str
    ) -> bytes | None:
        if use == tuple(range(self.codec.k)):  # the data shards: join them, no decode
            joined = self.codec.join_data(fragments)
            if joined is not None and hashlib.sha256(joined).hexdigest() == checksum:
                return joined
        try:
            data = self.codec.decode(fragments, use)
        except BadFragments:
            return None
        return data if hashlib.sha256(data).hexdigest() == checksum else None

    def _search(
        self, fragments: dict[int, Fragment], checksum: str, skip: tuple[int, ...]
    ) -> tuple[bytes, tuple[int, ...]] | None:
        """The first ``k``-subset of ``fragments`` that reproduces the checksum (at most
        C(12, 10) = 66 decodes, only for a block with a wrong shard behind a valid CRC)."""
        for use in combinations(sorted(fragments), self.codec.k):
            if use == skip:
                continue
            data = self._decode(fragments, use, checksum)
            if data is not None:
                return data, use
        return None

    def _unreadable(self, hex_: str, scan: ShardScan) -> BlockUnreadable:
        down = sorted(set(scan.down.values()))
        where = f"{len(scan.bad)} damaged; targets down: {', '.join(down) or 'none'}"
        if len(scan.fragments) < self.codec.k:
            msg = (
                f"block {hex_}: only {len(scan.fragments)} of {self.codec.n} shards readable, "
                f"{self.codec.k} needed ({where})"
            )
        else:
            msg = (
                f"block {hex_}: no {self.codec.k} of its {len(scan.fragments)} readable shards "
                f"rebuild the block checksum ({where})"
            )
        return BlockUnreadable(msg, damaged=not down, down=down)

    def repair(
        self, hex_: str, placement: list[str], data: bytes, bad: list[int], attempt: str
    ) -> int:
        """Rewrite the ``bad`` shards from the block's verified bytes; returns how many."""
        if not bad:
            return 0
        shards = self.codec.encode(data)
        for i in sorted(set(bad)):
            self.target(placement[i]).put(shard_key(hex_, i, attempt), shards[i])
        log.warning("block %s: rewrote shards %s", hex_, sorted(set(bad)))
        return len(set(bad))
