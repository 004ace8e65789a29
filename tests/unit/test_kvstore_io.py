"""The shard format without servers: the shard CRC (ISA-L's, where it loads) is zlib's CRC-32
from any start, and unwrap hands back the fragment as a view of the shard it was read in."""

from __future__ import annotations

import random
import zlib

import pytest

from services.kvstore import ec


def test_shard_crc_is_zlibs_crc32_from_any_start() -> None:
    data = random.Random(3).randbytes(3 * 4096 + 5)
    for start in (0, 1, 8, 4096, len(data) - 1, len(data)):
        assert ec.crc32(data, start) == zlib.crc32(data[start:])
    with pytest.raises(ValueError):
        ec.crc32(data, len(data) + 1)
    with pytest.raises(ValueError):
        ec.crc32(data, -1)


def test_unwrap_returns_the_fragment_and_refuses_a_flipped_bit() -> None:
    data = random.Random(4).randbytes(100_003)
    shard = ec.wrap(data)
    assert zlib.crc32(data) == int.from_bytes(shard[4:8], "little"), "the on-disk format is kept"
    view = ec.unwrap(shard)
    assert isinstance(view, memoryview) and view == data
    for pos in (len(shard) - 1, 8, 5):  # the fragment's last and first byte, the CRC itself
        flipped = bytearray(shard)
        flipped[pos] ^= 0x40
        assert ec.unwrap(bytes(flipped)) is None
    assert ec.unwrap(shard[:7]) is None and ec.unwrap(None) is None
