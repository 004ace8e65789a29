"""Host buffers for exported blocks (libs/engine/kv/pinned.py), reused once read: never two
exports in one buffer, never a read after it went back, and a bounded amount kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.engine.kv.cache import Pending
from libs.engine.kv.pinned import PinnedRows, StagingRing


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


def test_the_staging_ring_sends_every_array_whole_across_its_wrap() -> None:
    """Small host arrays pass through one reused buffer on their way to the device: each
    arrives with its values, dtype and shape, also after the ring came round, and what was sent
    earlier is not changed by what is sent later (on the CPU the copy is a clone; the CUDA
    event that guards a span is tests/gpu/test_staging_ring_gpu.py's)."""
    ring = StagingRing(torch.device("cpu"), nbytes=4096)
    rng = np.random.default_rng(0)
    sent = []
    for i in range(60):  # ~60 * 256 bytes: the 4 KiB ring comes round several times
        dtype = (np.int64, np.int32, np.float32)[i % 3]
        arr = rng.integers(-1000, 1000, size=(int(rng.integers(1, 16)), 3)).astype(dtype)
        sent.append((arr, ring.send(arr)))
    for arr, out in sent:
        assert out.shape == arr.shape and out.numpy().dtype == arr.dtype
        assert np.array_equal(out.numpy(), arr)
    big = np.arange(1024, dtype=np.int64)  # over an eighth of the ring: pinned on its own
    assert np.array_equal(ring.send(big).numpy(), big)
    strided = np.arange(40, dtype=np.int64)[::3]  # not contiguous: copied whole all the same
    assert np.array_equal(ring.send(strided).numpy(), strided)


class _QueuedCopy:
    """A copy the 'device' runs only when waited for: it reads the ring's span then, so a span
    rewritten before that would arrive changed."""

    def __init__(self, host: torch.Tensor, out: torch.Tensor) -> None:
        self.host, self.out, self.done = host, out, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.out.copy_(self.host)
            self.done = True


class _SlowDeviceRing(StagingRing):
    def __init__(self, nbytes: int) -> None:
        super().__init__(torch.device("cpu"), nbytes)
        self.copies: list[_QueuedCopy] = []

    def _copy(self, host: torch.Tensor) -> tuple[torch.Tensor, _QueuedCopy]:
        copy = _QueuedCopy(host, torch.empty_like(host))
        self.copies.append(copy)
        return copy.out, copy


def test_the_ring_rewrites_no_span_whose_copy_has_not_run() -> None:
    """Copies that run late (here: only when waited for) still read what was sent, also when
    a wrap skips the tail of the ring: 256- and 512-byte spans in a 4 KiB ring, so a span
    too long for the tail sends the next one to the start while the tail's copy is queued."""
    ring = _SlowDeviceRing(4096)
    rng = np.random.default_rng(2)
    sent = []
    # 16 spans fill the ring, 15 more come round to 3,840, then 512 bytes do not fit in the
    # tail (whose copy, from the first round, is still queued) and go to the start, over
    # spans of the second round; then a mix.
    words = [32] * 31 + [64] + [64 if i % 7 == 6 else 32 for i in range(60)]
    for w in words:
        arr = rng.integers(0, 1 << 50, size=w, dtype=np.int64)
        sent.append((arr, ring.send(arr)))
    for copy in ring.copies:  # the device catches up
        copy.synchronize()
    for arr, out in sent:
        assert np.array_equal(out.numpy(), arr)
    assert ring.waits > 0
