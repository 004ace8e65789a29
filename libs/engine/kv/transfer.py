"""Serialized KV: the unit the kvstore stores and prefill sends to decode.

A frame is ``MAGIC | u16 version | u32 header length | header (JSON) | payload``. The header
describes itself fully -- model id, layout hash, block size, dtype, bytes per block, the
number of tokens covered, the index of the frame's first block in its request's chain, and
the chain digest of every block (the last one may be a partial tail) -- so a reader can
reject a frame made for another model, layout or prompt before touching its bytes. The
payload is ``num_blocks`` blocks of ``bytes_per_block`` bytes; each block is the block's slice
of every paged entry, in spec order.

Integrity: with a key (held only by the serving tier: prefill and decode), a frame carries
``mac`` = HMAC-SHA-256(key, header without the mac || payload) in its header; :func:`verify`
rejects a frame whose mac is missing or wrong (:class:`KVIntegrityError`), so bytes that were
forged or altered in the kvstore can never be imported as a tenant's prefix.

No torch here: the engine fills and reads the payload.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, replace

from .layout import CacheSpec

MAGIC = b"DSKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
MAX_HEADER_BYTES = 1 << 24


class KVFormatError(ValueError):
    """The bytes are not a valid KV frame for this engine (fatal for that transfer)."""


class KVIntegrityError(KVFormatError):
    """The frame's MAC is missing or does not match its bytes (forged or altered)."""


@dataclass(frozen=True)
class KVHeader:
    model_id: str
    layout_hash: str
    block_size: int
    dtype: str
    bytes_per_block: int
    num_tokens: int  # tokens covered, counted from position 0 of the request
    first_block: int
    block_hashes: tuple[str, ...]  # hex digests, one per block in the frame
    mac: str = ""  # hex HMAC-SHA-256 over the header without it and the payload ("": none)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def chain_hash(self) -> str:
        return self.block_hashes[-1] if self.block_hashes else ""

    def to_json(self) -> bytes:
        d = {
            "model_id": self.model_id,
            "layout_hash": self.layout_hash,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "bytes_per_block": self.bytes_per_block,
            "num_tokens": self.num_tokens,
            "first_block": self.first_block,
            "num_blocks": self.num_blocks,
            "chain_hash": self.chain_hash,
            "block_hashes": list(self.block_hashes),
        }
        if self.mac:
            d["mac"] = self.mac
        return json.dumps(d, separators=(",", ":")).encode()


@dataclass(frozen=True)
class PeerKV:
    """KV blocks that sit in another engine's pool on this host (``pool``: its share handle,
    see :mod:`.peer`): what a same-host hand-off sends instead of a frame's bytes.

    Covers blocks ``first_block ..`` of a request's chain (``num_tokens`` tokens from 0);
    the owner keeps ``block_ids`` unchanged until the importing engine says it is done.
    """

    pool: bytes
    block_ids: tuple[int, ...]
    first_block: int
    num_tokens: int
    block_hashes: tuple[str, ...]


def frame_mac(key: bytes, header: KVHeader, payload: bytes | memoryview) -> str:
    """The MAC a frame of ``header`` and ``payload`` carries under ``key`` (hex)."""
    m = hmac.new(key, replace(header, mac="").to_json(), hashlib.sha256)
    m.update(payload)
    return m.hexdigest()


def encode_frame(header: KVHeader, payload: bytes, key: bytes | None = None) -> bytes:
    """The frame's bytes; with ``key``, its header carries the MAC of both."""
    expected = header.num_blocks * header.bytes_per_block
    if len(payload) != expected:
        raise ValueError(f"payload is {len(payload)} bytes, header says {expected}")
    if key:
        header = replace(header, mac=frame_mac(key, header, payload))
    head = header.to_json()
    return _PREFIX.pack(MAGIC, VERSION, len(head)) + head + payload


def decode_frame(data: bytes | memoryview) -> tuple[KVHeader, memoryview]:
    """Parse a frame; raises :class:`KVFormatError` with the reason if it is malformed."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise KVFormatError(f"KV frame too short ({len(view)} bytes)")
    magic, version, head_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise KVFormatError("not a deepserve KV frame (bad magic)")
    if version != VERSION:
        raise KVFormatError(f"KV frame version {version} is not supported (expected {VERSION})")
    if head_len > MAX_HEADER_BYTES or _PREFIX.size + head_len > len(view):
        raise KVFormatError("KV frame header length is out of range")
    head = bytes(view[_PREFIX.size : _PREFIX.size + head_len])
    try:
        raw = json.loads(head)
        header = KVHeader(
            model_id=str(raw["model_id"]),
            layout_hash=str(raw["layout_hash"]),
            block_size=int(raw["block_size"]),
            dtype=str(raw["dtype"]),
            bytes_per_block=int(raw["bytes_per_block"]),
            num_tokens=int(raw["num_tokens"]),
            first_block=int(raw["first_block"]),
            block_hashes=tuple(str(h) for h in raw["block_hashes"]),
            mac=str(raw.get("mac", "")),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise KVFormatError(f"KV frame header is malformed: {exc}") from None
    if header.to_json() != head:  # the MAC covers the parsed header: no other spelling of it
        raise KVFormatError("KV frame header is not in its canonical form")
    payload = view[_PREFIX.size + head_len :]
    if len(payload) != header.num_blocks * header.bytes_per_block:
        raise KVFormatError(
            f"KV frame payload is {len(payload)} bytes, header promises "
            f"{header.num_blocks} x {header.bytes_per_block}"
        )
    bs = header.block_size
    if (
        bs <= 0
        or not header.first_block * bs
        <= header.num_tokens
        <= (header.first_block + header.num_blocks) * bs
    ):
        raise KVFormatError("KV frame token count does not match its blocks")
    return header, payload


def verify(key: bytes | None, header: KVHeader, payload: bytes | memoryview) -> None:
    """Raise :class:`KVIntegrityError` unless the frame carries the right MAC for ``key``
    (no key: nothing is checked -- frames are then only as trusted as their transport)."""
    if not key:
        return
    if not header.mac:
        raise KVIntegrityError("KV frame carries no MAC; this engine only imports signed frames")
    given = header.mac.encode(errors="replace")  # a str MAC may hold any character
    if not hmac.compare_digest(given, frame_mac(key, header, payload).encode()):
        raise KVIntegrityError("KV frame MAC does not match its bytes (forged or altered)")


def check_compatible(header: KVHeader, spec: CacheSpec) -> None:
    """Raise :class:`KVFormatError` unless the frame was made for this cache layout."""
    problems = []
    if header.model_id != spec.model_id:
        problems.append(f"model {header.model_id!r} != {spec.model_id!r}")
    if header.layout_hash != spec.layout_hash():
        problems.append("cache layout differs")
    if header.block_size != spec.block_size:
        problems.append(f"block size {header.block_size} != {spec.block_size}")
    if header.dtype != spec.dtype:
        problems.append(f"dtype {header.dtype} != {spec.dtype}")
    if header.bytes_per_block != spec.bytes_per_block:
        problems.append(f"bytes per block {header.bytes_per_block} != {spec.bytes_per_block}")
    if problems:
        raise KVFormatError("KV frame does not fit this engine: " + "; ".join(problems))
