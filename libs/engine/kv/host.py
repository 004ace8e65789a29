"""A KV block store of host bytes: block id -> ``bytes_per_block`` bytes, kept in a dict.

For engines whose cache is not a device pool: the fake engine's 4-byte-per-token stand-in and
DeepSeek-V4's state blocks (``libs.engine.v4.serving``), which subclass it. Only blocks ever
written take memory; a block never written reads as zeros. Bytes stay in this process: no
peer on the host can map them (``share`` gives no handle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from .peer import PeerUnavailable


class HostBlockStore:
    """The :class:`~libs.engine.parts.KVBlockStore` interface over a dict of bytes."""

    def __init__(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block
        self._blocks: dict[int, bytes] = {}

    def read_blocks(self, blocks: Sequence[int]) -> bytes:
        zero = bytes(self.bytes_per_block)
        return b"".join(self._blocks.get(b, zero) for b in blocks)

    def write_blocks(self, blocks: Sequence[int], payload: bytes | memoryview) -> None:
        bpb = self.bytes_per_block
        if len(payload) != len(blocks) * bpb:
            raise ValueError(f"payload is {len(payload)} bytes, expected {len(blocks)} x {bpb}")
        for i, b in enumerate(blocks):
            self._blocks[b] = bytes(payload[i * bpb : (i + 1) * bpb])

    # The engine's off-thread halves: here everything is host bytes already.
    def stage(self, payloads: Sequence[bytes | memoryview]) -> bytes:
        return b"".join(bytes(p) for p in payloads)

    def write_staged(self, blocks: Sequence[int], staged: bytes, start: int = 0) -> None:
        bpb = self.bytes_per_block
        self.write_blocks(blocks, staged[start * bpb : (start + len(blocks)) * bpb])

    def gather_async(self, blocks: Sequence[int]) -> Ready:
        return Ready(self.read_blocks(blocks))

    def share(self) -> None:
        """A dict of bytes lives in this process only: peers get the KV as bytes."""
        return None

    def open_peer(self, handle: bytes) -> NoReturn:
        raise PeerUnavailable("a host block store cannot map another engine's pool")

    def copy_from_peer(self, src: object, src_blocks: object, dst_blocks: object) -> NoReturn:
        raise PeerUnavailable("a host block store cannot map another engine's pool")


class Ready:
    """A gather that is already done."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def result(self) -> bytes:
        return self.data
