"""Page-locked host memory: buffers for blocks copied off the device, kept and handed out
again (:class:`PinnedRows`), and small host arrays sent to the device without waiting
(:func:`to_device`).

Every finished request's new blocks are gathered on the engine thread and copied to host memory
for the kvstore (and a prefill's for a hand-off). Page-locked memory is what lets that copy run
on its own stream beside the next steps, but allocating it is slow: profiled with py-spy on an
H100 (aggregated v2-lite, chat trace at 128 sessions), ``torch.empty(..., pin_memory=True)``
for each export took 11.5% of the engine thread's time, time in which it did not step. So the
buffers are kept once a caller is done with them and handed out again, in power-of-two row
counts (a request of 5 blocks gets an 8-block buffer and uses 5 rows), up to ``keep_bytes``
kept in all (beyond it a returned buffer is freed). Any thread.
"""

from __future__ import annotations

import threading

import numpy as np
import torch


def to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """``arr`` on ``device``: pinned and non-blocking on CUDA (a plain copy to the device would
    wait for the work queued before it)."""
    t = torch.from_numpy(arr)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class PinnedRows:
    """Page-locked ``[rows, row_bytes]`` uint8 buffers, reused. ``pin``: False gives plain
    host memory (the same bookkeeping, where there is no CUDA)."""

    def __init__(self, row_bytes: int, keep_bytes: int = 1 << 30, pin: bool = True) -> None:
        if row_bytes <= 0 or keep_bytes < 0:
            raise ValueError("row_bytes must be > 0 and keep_bytes >= 0")
        self.row_bytes, self.keep_bytes, self.pin = row_bytes, keep_bytes, pin
        self.kept_bytes = 0
        self.allocated = 0  # buffers made (not handed out again): what reuse saves
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, rows: int) -> torch.Tensor:
        """A buffer of at least ``rows`` rows (a power of two); use ``buf[:rows]``, and
        :meth:`give` it back once nothing reads it any more."""
        if rows <= 0:
            raise ValueError(f"rows must be positive, got {rows}")
        cap = 1 << (rows - 1).bit_length()
        with self._lock:
            free = self._free.get(cap)
            if free:
                buf = free.pop()
                self.kept_bytes -= buf.numel()
                return buf
            self.allocated += 1
        return torch.empty((cap, self.row_bytes), dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` (from :meth:`take`) for a later :meth:`take`; freed instead when the
        kept buffers would pass ``keep_bytes``."""
        with self._lock:
            if self.kept_bytes + buf.numel() <= self.keep_bytes:
                self._free.setdefault(buf.shape[0], []).append(buf)
                self.kept_bytes += buf.numel()
