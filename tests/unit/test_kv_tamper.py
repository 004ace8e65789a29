"""Tampering with stored KV never gets it imported (DESIGN.md, trust boundary: the bytes of every
stored KV block are bound to their name by a keyed MAC the engine checks before importing).

A KV frame's every header field, its block names, its lengths and its payload: one changed
value, re-spelled header or flipped bit makes the engine's import path (``decode_frame``, then
``verify`` -- what ``Engine.prepare_kv`` runs) raise :class:`KVFormatError` (or its
:class:`KVIntegrityError`), which the prefill service counts as a miss and computes instead.
The MAC alone is tested for every header field: the tampered frame stays well-formed, so only
the MAC can refuse it. Then the kvstore's shard format: its magic, its CRC, pyeclib's fragment
header behind a valid CRC, and the block's SHA-256 in metadata -- a read never returns bytes
other than the block's.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from libs.engine.kv.transfer import (
    MAGIC,
    VERSION,
    KVFormatError,
    KVHeader,
    KVIntegrityError,
    decode_frame,
    encode_frame,
    verify,
)
from services.kvstore.ec import HEAD_SIZE, Codec, unwrap, wrap
from services.kvstore.shards import BlockUnreadable, ShardIO
from services.kvstore.targets import TargetDown, shard_key

KEY = b"serving-tier-secret"
BPB = 8
HEADER = KVHeader(
    model_id="tiny",
    layout_hash="0123abcd",
    block_size=4,
    dtype="bfloat16",
    bytes_per_block=BPB,
    num_tokens=10,
    first_block=0,
    block_hashes=("11" * 32, "22" * 32, "33" * 32),  # two full blocks and a tail
)
PAYLOAD = bytes(range(3 * BPB))
FRAME = encode_frame(HEADER, PAYLOAD, KEY)


def imported(frame: bytes) -> KVHeader:
    """What the engine's import path does with a frame before it touches the cache."""
    header, payload = decode_frame(frame)
    verify(KEY, header, payload)
    return header


def parts(frame: bytes) -> tuple[dict[str, Any], bytes]:
    (head_len,) = struct.unpack_from("<I", frame, 6)
    return json.loads(frame[10 : 10 + head_len]), frame[10 + head_len :]


def rebuilt(head: dict[str, Any] | bytes, payload: bytes, head_len: int | None = None) -> bytes:
    """A frame of this header (canonical JSON unless given as bytes) and payload."""
    raw = head if isinstance(head, bytes) else json.dumps(head, separators=(",", ":")).encode()
    size = len(raw) if head_len is None else head_len
    return struct.pack("<4sHI", MAGIC, VERSION, size) + raw + payload


def test_the_untampered_frame_imports() -> None:
    assert imported(FRAME) == KVHeader(**{**HEADER.__dict__, "mac": parts(FRAME)[0]["mac"]})
    assert imported(rebuilt(*parts(FRAME))).block_hashes == HEADER.block_hashes


# Each: (field, new value, payload change). The new values keep the frame well-formed (its
# length and token-count checks pass), so the MAC is what must refuse it.
SIGNED_CHANGES: list[tuple[str, Any, Callable[[bytes], bytes]]] = [
    ("model_id", "tiny2", lambda p: p),
    ("model_id", "", lambda p: p),
    ("layout_hash", "0123abce", lambda p: p),
    ("block_size", 5, lambda p: p),
    ("block_size", 6, lambda p: p),
    ("dtype", "float16", lambda p: p),
    ("dtype", "float8_e4m3fn", lambda p: p),
    ("bytes_per_block", BPB // 2, lambda p: p[: 3 * BPB // 2]),
    ("bytes_per_block", BPB + 1, lambda p: p + b"\0\0\0"),
    ("num_tokens", 9, lambda p: p),
    ("num_tokens", 12, lambda p: p),
    ("first_block", 1, lambda p: p),
    ("block_hashes", ["11" * 32, "22" * 32, "34" + "33" * 31], lambda p: p),  # the tail's name
    ("block_hashes", ["12" + "11" * 31, "22" * 32, "33" * 32], lambda p: p),  # the first's
    ("block_hashes", ["22" * 32, "11" * 32, "33" * 32], lambda p: p),  # two names swapped
    ("block_hashes", ["11" * 32, "22" * 32, "33" * 32, "44" * 32], lambda p: p + bytes(BPB)),  # +1
    ("block_hashes", ["11" * 32, "22" * 32, "33" * 32], lambda p: p[:-1] + b"\xff"),  # payload
    ("block_hashes", ["11" * 32, "22" * 32, "33" * 32], lambda p: p[BPB:] + p[:BPB]),  # reorder
]


def _with(field: str, value: Any) -> dict[str, Any]:
    head = parts(FRAME)[0]
    head[field] = value
    if field == "block_hashes":  # keep the derived fields consistent: only the MAC can tell
        head["num_blocks"], head["chain_hash"] = len(value), value[-1]
    return head


@pytest.mark.parametrize(
    ("field", "value", "payload"),
    SIGNED_CHANGES,
    ids=[f"{f}={str(v)[:12]}-{i}" for i, (f, v, _) in enumerate(SIGNED_CHANGES)],
)
def test_every_signed_field_is_bound_by_the_mac(
    field: str, value: Any, payload: Callable[[bytes], bytes]
) -> None:
    tampered = rebuilt(_with(field, value), payload(parts(FRAME)[1]))
    decode_frame(tampered)  # well-formed: nothing but the MAC stands in the way
    with pytest.raises(KVIntegrityError, match="does not match"):
        imported(tampered)


@pytest.mark.parametrize(
    "mac",
    [
        "",  # stripped: an unsigned frame
        "0" * 64,
        "A" * 64,
        None,  # spelled as JSON null
        "é" * 64,  # not ASCII: was a TypeError out of hmac.compare_digest, not a refusal
        "\ud800" * 64,  # a lone surrogate: cannot even be encoded as UTF-8
    ],
    ids=["empty", "zeros", "upper", "null", "non-ascii", "surrogate"],
)
def test_a_wrong_or_missing_mac_is_refused(mac: str | None) -> None:
    head, payload = parts(FRAME)
    right = head["mac"]
    head["mac"] = mac
    with pytest.raises(KVFormatError):
        imported(rebuilt(head, payload))
    head["mac"] = right.upper()
    with pytest.raises(KVIntegrityError):
        imported(rebuilt(head, payload))
    del head["mac"]
    with pytest.raises(KVIntegrityError, match="no MAC"):
        imported(rebuilt(head, payload))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_blocks", 2),  # derived from block_hashes: was read past unchecked
        ("num_blocks", 4),
        ("chain_hash", "22" * 32),  # likewise
        ("block_size", "4"),  # the same value spelled as a string: was accepted
        ("block_size", 4.0),  # or as a float
        ("num_tokens", True),
        ("extra", "x"),  # a key no reader knows
    ],
)
def test_another_spelling_of_the_header_is_refused(field: str, value: Any) -> None:
    """The MAC covers the header as parsed, so a frame may have only one spelling of it: any
    other -- a wrong derived field, a number as a string, an unknown key -- is refused."""
    head, payload = parts(FRAME)
    head[field] = value
    with pytest.raises(KVFormatError, match="canonical"):
        imported(rebuilt(head, payload))
    raw = json.dumps(parts(FRAME)[0], separators=(",", ":"), indent=1).encode()
    with pytest.raises(KVFormatError, match="canonical"):
        imported(rebuilt(raw, payload))


def test_the_frame_prefix_and_lengths_are_checked() -> None:
    head, payload = parts(FRAME)
    raw = json.dumps(head, separators=(",", ":")).encode()
    for bad, reason in [
        (b"DSKW" + FRAME[4:], "magic"),
        (FRAME[:4] + struct.pack("<H", VERSION + 1) + FRAME[6:], "version"),
        (rebuilt(raw, payload, len(raw) + 1), "header"),  # header length one too long
        (rebuilt(raw, payload, len(raw) - 1), "header"),  # one too short
        (rebuilt(raw, payload, len(raw) + len(payload) + 1), "header length"),
        (rebuilt(raw, payload, 1 << 30), "header length"),
        (rebuilt(raw, payload[:-1]), "payload"),  # payload one byte short
        (rebuilt(raw, payload + b"\0"), "payload"),  # one byte long
        (rebuilt(raw, b""), "payload"),
        (FRAME[:9], "too short"),
    ]:
        with pytest.raises(KVFormatError, match=reason):
            imported(bad)


def test_no_single_bit_flip_anywhere_in_a_frame_imports() -> None:
    """Every bit of the frame -- prefix, each header byte, each payload byte -- flipped alone
    is refused, and always as a KVFormatError (never another exception that would fail the
    request instead of making it a miss)."""
    for pos in range(len(FRAME)):
        for bit in range(8):
            bad = bytearray(FRAME)
            bad[pos] ^= 1 << bit
            with pytest.raises(KVFormatError):
                imported(bytes(bad))


def test_a_frame_signed_with_another_key_is_refused() -> None:
    with pytest.raises(KVIntegrityError):
        imported(encode_frame(HEADER, PAYLOAD, b"another key"))
    with pytest.raises(KVIntegrityError, match="no MAC"):
        imported(encode_frame(HEADER, PAYLOAD))


# -- kvstore shards -------------------------------------------------------------------------


class MemTarget:
    """A target in memory, as :class:`services.kvstore.targets.DirTarget` behaves."""

    def __init__(self, name: str) -> None:
        self.name, self.data, self.down = name, {}, False

    def prepare(self) -> None:
        pass

    def put(self, key: str, data: bytes) -> None:
        self.data[key] = bytes(data)

    def get(self, key: str) -> bytes | None:
        if self.down:
            raise TargetDown(self.name)
        return self.data.get(key)

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def keys(self) -> Iterator[tuple[str, float]]:
        return iter((k, 0.0) for k in self.data)


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(k=4, m=2)


@pytest.fixture
def stored(codec: Codec) -> Iterator[tuple[ShardIO, list[MemTarget], bytes, str]]:
    import hashlib

    targets = [MemTarget(f"t{i}") for i in range(codec.n)]
    io = ShardIO(targets, codec, workers=2)
    data = random.Random(5).randbytes(10_007)
    io.write("ab" * 32, data, [t.name for t in targets], "a1")
    try:
        yield io, targets, data, hashlib.sha256(data).hexdigest()
    finally:
        io.close()


def _shard(targets: list[MemTarget], i: int) -> bytes:
    return targets[i].data[shard_key("ab" * 32, i, "a1")]


def _put_shard(targets: list[MemTarget], i: int, shard: bytes) -> None:
    targets[i].data[shard_key("ab" * 32, i, "a1")] = shard


def _read(io: ShardIO, targets: list[MemTarget], checksum: str) -> tuple[bytes, list[int]]:
    data, scan = io.read("ab" * 32, [t.name for t in targets], checksum, "a1")
    return data, sorted(scan.bad)


def test_each_shard_header_field_is_checked() -> None:
    shard = wrap(b"fragment bytes")
    assert bytes(unwrap(shard)) == b"fragment bytes"
    for pos in range(len(shard)):  # magic (0..3), CRC (4..7), fragment: any byte
        bad = bytearray(shard)
        bad[pos] ^= 0x01
        assert unwrap(bytes(bad)) is None, pos
    assert unwrap(shard[:-1]) is None and unwrap(shard + b"\0") is None


# pyeclib's fragment header (liberasurecode's fragment_header_t, little-endian): index at 0,
# fragment size at 4, original data size at 12, then checksums, magic at 59, version at 63,
# the metadata checksum at 67.
FRAGMENT_FIELDS = {"index": 0, "size": 4, "orig_data_size": 12, "magic": 59, "meta_crc": 67}


@pytest.mark.parametrize("field", sorted(FRAGMENT_FIELDS))
def test_a_fragment_header_altered_behind_a_valid_crc_is_a_bad_shard(
    stored: tuple[ShardIO, list[MemTarget], bytes, str], field: str
) -> None:
    """A data shard whose erasure-code header was changed and re-wrapped (so its CRC passes):
    the read still returns exactly the block's bytes and names that shard as bad."""
    io, targets, data, checksum = stored
    frag = bytearray(_shard(targets, 1)[HEAD_SIZE:])
    frag[FRAGMENT_FIELDS[field]] ^= 0x01
    _put_shard(targets, 1, wrap(bytes(frag)))
    got, bad = _read(io, targets, checksum)
    assert got == data and bad == [1]


def test_a_shard_with_wrong_bytes_behind_a_valid_crc_is_caught_by_the_block_sha256(
    stored: tuple[ShardIO, list[MemTarget], bytes, str],
) -> None:
    io, targets, data, checksum = stored
    frag = bytearray(_shard(targets, 2)[HEAD_SIZE:])
    frag[-1] ^= 0x80  # a data byte of the fragment, past its header
    _put_shard(targets, 2, wrap(bytes(frag)))
    got, bad = _read(io, targets, checksum)
    assert got == data and bad == [2]


def test_a_read_never_returns_bytes_whose_sha256_differs(
    stored: tuple[ShardIO, list[MemTarget], bytes, str],
) -> None:
    io, targets, data, checksum = stored
    wrong = ("0" if checksum[0] != "0" else "1") + checksum[1:]
    with pytest.raises(BlockUnreadable, match="checksum") as info:
        _read(io, targets, wrong)  # every shard intact, the metadata's checksum differs
    assert info.value.damaged
    for i in (0, 3, 5):  # more wrong shards behind valid CRCs than parity can outvote
        frag = bytearray(_shard(targets, i)[HEAD_SIZE:])
        frag[-1] ^= 0x80
        _put_shard(targets, i, wrap(bytes(frag)))
    with pytest.raises(BlockUnreadable):
        _read(io, targets, checksum)


def test_shards_failing_their_crc_are_bad_and_parity_rebuilds_the_block(
    stored: tuple[ShardIO, list[MemTarget], bytes, str],
) -> None:
    io, targets, data, checksum = stored
    for i, pos in ((0, 0), (3, 5)):  # shard 0's magic, shard 3's CRC
        bad = bytearray(_shard(targets, i))
        bad[pos] ^= 0x01
        _put_shard(targets, i, bytes(bad))
    got, bad = _read(io, targets, checksum)
    assert got == data and bad == [0, 3]
