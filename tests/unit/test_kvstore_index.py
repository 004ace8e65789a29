"""The LRU index's read side without a server: the hand-packed ZMSCORE is byte for byte what
redis-py would send, and the prefix/TTL arithmetic stops where the Lua script did."""

from __future__ import annotations

import hashlib

import pytest
from redis.connection import Connection

from services.kvstore.index import leading, pack_zmscore


def digests(n: int) -> list[bytes]:
    return [hashlib.sha256(b"%d" % i).digest() for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 2048])
def test_packed_zmscore_is_what_redis_py_sends(n: int) -> None:
    hashes = digests(n)
    conn = Connection()  # type: ignore[no-untyped-call]  # redis-py: untyped; never connects
    parts = conn.pack_command("ZMSCORE", "ds:kv:_lru", *[h.hex() for h in hashes])  # type: ignore[no-untyped-call]
    want = b"".join(parts)
    assert pack_zmscore("ds:kv:_lru", hashes) == want


def test_packing_refuses_what_is_not_a_list_of_digests() -> None:
    with pytest.raises(ValueError):
        pack_zmscore("k", [])
    with pytest.raises(ValueError):
        pack_zmscore("k", [b"short"])


def test_leading_stops_at_the_first_missing_and_names_only_old_blocks() -> None:
    now, day = 1_000_000.0, 86_400.0
    assert leading([], now, day) == (0, [])
    assert leading([None, now], now, day) == (0, [])
    assert leading([now, now - 10, None, now - 5 * day], now, day) == (2, [])
    scores = [now, now - day, now - 2 * day, now - day + 1, None]
    assert leading(scores, now, day) == (4, [1, 2]), "age == shortest TTL is old (as the TTL)"
    resp2 = [b"%r" % s for s in scores[:4]] + [None]  # a RESP2 connection: scores as bytes
    assert leading(resp2, now, day) == (4, [1, 2])
