"""Pool references signed like KV frames: a decode instance maps only what a prefill peer
made for that very request, once, and only lately.

A same-host hand-over sends :class:`~libs.engine.kv.transfer.PeerKV` -- a handle of the
prefill engine's KV pool (CUDA IPC, or a memfd the opener maps through ``/proc/<pid>/fd``) and
block ids in it -- instead of bytes; decode opens the handle and copies the blocks. A handle
made up by anyone else would make decode open another process's memory or file and stream its
bytes as tokens, with no frame MAC to stop it. So the prefill side :func:`seal`\\ s the
reference under the KV MAC key (``--kv-mac-key``, which only prefill and decode instances
hold): ``HMAC-SHA-256(key, request id, issue time, handle, block ids, first block, tokens,
block names)``, carried in front of the handle. The decode side's :class:`PeerSeals` refuses,
before anything is opened or imported, a reference that is unsigned or signed under another
key (made up), bound to another request (another tenant's, or another of the same tenant's),
changed after signing (block ids pointing elsewhere in or outside the pool), older than
``MAX_AGE_S`` or used before (replayed).

Without a key nothing is signed or checked, as for frames (local use).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
from collections.abc import Callable
from dataclasses import replace

from libs.common.errors import InvalidArgument
from libs.engine.kv.transfer import PeerKV

from .aborts import RecentIds

MAGIC = b"DSPK1"  # a sealed handle starts with it, then the issue time and the MAC
_HEAD = struct.Struct(">5sd32s")  # magic, issue time (unix seconds), HMAC-SHA-256
_DOMAIN = b"deepserve/peer-kv/v1\x00"
# A reference is used within the hand-over that made it (milliseconds; a push waits at most
# --push-timeout, 30 s by default): a minute covers it, and the skew of one host's clock.
MAX_AGE_S = 60.0
MAX_AHEAD_S = 5.0
MAX_REMEMBERED = 100_000  # MACs of references taken within MAX_AGE_S (~10 MB at most)


class PeerKVRefused(InvalidArgument):
    """A pool reference decode will not open: unsigned, forged, another request's, stale or
    replayed. Nothing of it was mapped or imported."""


def _mac(key: bytes, request_id: str, issued: float, kv: PeerKV) -> bytes:
    fields = [
        request_id,
        repr(issued),
        kv.pool.hex(),
        list(kv.block_ids),
        kv.first_block,
        kv.num_tokens,
        list(kv.block_hashes),
    ]
    body = json.dumps(fields, separators=(",", ":")).encode()
    return hmac.new(key, _DOMAIN + body, hashlib.sha256).digest()


def seal(kv: PeerKV, request_id: str, key: bytes | None, now: float | None = None) -> PeerKV:
    """``kv`` with its handle signed for ``request_id`` at ``now`` (unchanged without a key)."""
    if key is None:
        return kv
    issued = time.time() if now is None else now
    head = _HEAD.pack(MAGIC, issued, _mac(key, request_id, issued, kv))
    return replace(kv, pool=head + kv.pool)


class PeerSeals:
    """What a decode instance checks of each pool reference before it opens the pool."""

    def __init__(self, key: bytes | None, clock: Callable[[], float] = time.time) -> None:
        self.key, self.clock = key, clock
        self._used = RecentIds(MAX_AGE_S + MAX_AHEAD_S, MAX_REMEMBERED, clock=clock)

    def open(self, kv: PeerKV, request_id: str) -> PeerKV:
        """The reference as the engine takes it (its handle unwrapped), or
        :class:`PeerKVRefused` saying why; a reference is good for one use."""
        if self.key is None:
            return kv
        rid = request_id
        if len(kv.pool) <= _HEAD.size or not kv.pool.startswith(MAGIC):
            raise PeerKVRefused(
                f"KV pool reference for request {rid!r} is not signed; this decode instance "
                "opens only pools a prefill peer signed with the KV MAC key (refused, nothing "
                "imported)"
            )
        _, issued, mac = _HEAD.unpack_from(kv.pool)
        inner = replace(kv, pool=kv.pool[_HEAD.size :])
        if not hmac.compare_digest(mac, _mac(self.key, rid, issued, inner)):
            raise PeerKVRefused(
                f"KV pool reference for request {rid!r} does not match its MAC: made up, "
                "altered, or made for another request (refused, nothing imported)"
            )
        age = self.clock() - issued
        if not -MAX_AHEAD_S <= age <= MAX_AGE_S:
            raise PeerKVRefused(
                f"KV pool reference for request {rid!r} was issued {age:.0f} s ago; one is "
                f"good for {MAX_AGE_S:.0f} s (replayed? refused, nothing imported)"
            )
        tag = mac.hex()
        if tag in self._used:
            raise PeerKVRefused(
                f"KV pool reference for request {rid!r} was used already (replayed; refused, "
                "nothing imported)"
            )
        self._used.add(tag)
        return inner
