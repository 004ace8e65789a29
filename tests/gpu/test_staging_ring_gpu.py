"""Host arrays through the page-locked staging ring (libs/engine/kv/pinned.py) while the GPU
is busy: the ring comes round to spans whose copies are still queued behind the device's work,
and must wait for them rather than overwrite what they have yet to read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from libs.engine.kv.pinned import StagingRing, to_device  # noqa: E402


def test_no_span_is_overwritten_before_its_copy_ran() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    ring = StagingRing(dev, nbytes=8192)  # 32 spans of 256 bytes: round many times below
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of every copy
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 1 << 40, size=int(rng.integers(1, 32))) for _ in range(200)]
    outs = [ring.send(a) for a in arrays]
    torch.cuda.synchronize()
    for a, out in zip(arrays, outs, strict=True):
        assert out.device == dev and np.array_equal(out.cpu().numpy(), a)
    assert ring.waits > 0  # it did come round to copies still queued


def test_to_device_reuses_one_ring_per_device() -> None:
    dev = torch.device("cuda")
    a = np.arange(10, dtype=np.int32)
    assert to_device(a, dev).dtype == torch.int32
    assert np.array_equal(to_device(a, dev).cpu().numpy(), a)
