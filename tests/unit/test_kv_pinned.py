"""Host buffers for exported blocks (libs/engine/kv/pinned.py), reused once read: never two
exports in one buffer, never a read after it went back, and a bounded amount kept."""

from __future__ import annotations

import pytest
import torch

from libs.engine.kv.cache import Pending
from libs.engine.kv.pinned import PinnedRows


def test_a_buffer_is_handed_out_again_only_after_it_came_back() -> None:
    pool = PinnedRows(row_bytes=8, pin=False)
    a, b = pool.take(5), pool.take(5)  # two exports in flight: two buffers
    assert a.shape == (8, 8) and a.data_ptr() != b.data_ptr()
    pool.give(a)
    c = pool.take(7)  # the same power-of-two size: the buffer given back
    assert c.data_ptr() == a.data_ptr() and pool.allocated == 2
    assert pool.take(9).shape == (16, 8) and pool.allocated == 3


def test_the_memory_kept_is_bounded() -> None:
    pool = PinnedRows(row_bytes=8, keep_bytes=100, pin=False)
    bufs = [pool.take(8) for _ in range(3)]  # 64 bytes each
    for buf in bufs:
        pool.give(buf)
    assert pool.kept_bytes == 64  # the second and third were freed, not kept
    with pytest.raises(ValueError, match="rows"):
        pool.take(0)


def test_a_pending_copy_is_read_once_then_its_buffer_goes_back() -> None:
    pool = PinnedRows(row_bytes=4, pin=False)
    buf = pool.take(2)
    buf[:2] = torch.arange(8, dtype=torch.uint8).view(2, 4)
    pending = Pending(buf[:2], None, lambda: pool.give(buf))
    assert pending.result() == bytes(range(8))
    assert pool.kept_bytes == buf.numel()  # back in the pool
    with pytest.raises(RuntimeError, match="read already"):
        pending.result()  # would read whatever the next export put there
