"""The read side of the LRU index ``ds:kv:_lru`` (hex digest -> last use): what ``Lookup`` asks.

Every script in ``scripts.py`` writes, refreshes and removes a block's index entry together with
its metadata, so one ``ZMSCORE`` of a chain's digests says which blocks exist and when each was
last used. It is sent as a native command, not from a Lua script: Lua spent ~1 us per member
splitting, unpacking and converting (2-3 ms of server time for 2,048 hashes), where ZMSCORE
itself takes ~0.2 us per member. The command's RESP is built here in a few C passes instead of
by redis-py's packer (~1.3 us per argument: 2.7 ms for 2,048), and its reply is parsed by hiredis
when it is installed (redis-py's Python parser takes ~4 us per member).
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from libs.common.hashchain import DIGEST_SIZE

_HEX = 2 * DIGEST_SIZE


def pack_zmscore(key: str, hashes: Sequence[bytes]) -> bytes:
    """RESP of ``ZMSCORE key hex(h1) ... hex(hN)``; every hash is ``DIGEST_SIZE`` bytes (the
    caller checked) and ``hashes`` is not empty. One ``hexlify`` with a separator between
    digests, one ``replace`` turning each separator into the next argument's header, one join:
    ~90 us for 2,048 here (``str.hex`` then ``encode`` took ~270)."""
    joined = b"".join(hashes)
    if not hashes or len(joined) != DIGEST_SIZE * len(hashes):
        raise ValueError(f"ZMSCORE of {len(hashes)} digests: each must be {DIGEST_SIZE} bytes")
    members = binascii.hexlify(joined, b"|", DIGEST_SIZE).replace(b"|", b"\r\n$%d\r\n" % _HEX)
    k = key.encode()
    head = b"*%d\r\n$7\r\nZMSCORE\r\n$%d\r\n%s\r\n$%d\r\n" % (len(hashes) + 2, len(k), k, _HEX)
    return b"".join((head, members, b"\r\n"))


async def execute_packed(redis: aioredis.Redis, packed: bytes) -> Any:
    """Send one packed command on a pooled connection and return its raw reply (no response
    callback), with the connection's own retry policy on connection errors, as redis-py's
    ``execute_command`` does. A failed or cancelled exchange leaves the connection closed (a
    reply half read is never handed to the next command). Raises redis-py's errors."""
    pool = redis.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]  # redis-py: untyped

    async def once() -> Any:
        await conn.send_packed_command(packed)
        return await conn.read_response()

    async def reset(_error: Exception) -> None:
        await conn.disconnect()

    try:
        return await conn.retry.call_with_retry(once, reset)
    finally:
        await pool.release(conn)


def leading(scores: Sequence[Any], now: float, shortest_ttl: float) -> tuple[int, list[int]]:
    """From a chain's ZMSCORE reply (None: not in the index; a float, or its bytes under RESP2):
    how many leading blocks exist, and which of those (indices, in order) were last used at
    least ``shortest_ttl`` ago, so that only their own class's TTL can say whether they expired.
    """
    try:
        n = scores.index(None)
    except ValueError:
        n = len(scores)
    if n == 0:
        return 0, []
    # RESP3 replies carry floats already (redis-py's default protocol); RESP2 ones bytes.
    used = scores[:n] if isinstance(scores[0], float) else [float(s) for s in scores[:n]]
    if now - min(used) < shortest_ttl:  # the usual case: nothing is that old, no per-block test
        return n, []
    return n, [i for i, t in enumerate(used) if now - t >= shortest_ttl]
