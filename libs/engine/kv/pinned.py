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
from collections import deque
from typing import Any

import numpy as np
import torch


def to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """``arr`` on ``device``: through page-locked memory and non-blocking on CUDA (a plain copy
    to the device would wait for the work queued before it), from that device's
    :class:`StagingRing` (allocating page-locked memory for each array cost the engine thread
    ~0.5 ms a call: 10% of its time in the H100 chat profile, for two arrays a step)."""
    if device.type == "cuda":
        return _ring(device).send(arr)
    return torch.from_numpy(arr)


_RINGS: dict[torch.device, StagingRing] = {}
_RINGS_LOCK = threading.Lock()


def _ring(device: torch.device) -> StagingRing:
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    ring = _RINGS.get(device)
    if ring is None:
        with _RINGS_LOCK:
            ring = _RINGS.setdefault(device, StagingRing(device))
    return ring


class StagingRing:
    """One page-locked buffer (``nbytes``) that small host arrays pass through on their way to
    ``device``, used in turn: each array takes the next free span (256-byte aligned; wrapping
    to the start), is copied there and sent with a non-blocking copy, after which an event is
    recorded. A span is written again only once the copy that read it has run (its event,
    waited for if need be: the oldest spans are always the next ones written, so only the
    oldest is ever checked). Arrays over an eighth of the buffer are pinned on their own.
    Off CUDA (tests) the copy is a plain clone. Any thread."""

    ALIGN = 256

    def __init__(self, device: torch.device, nbytes: int = 8 << 20) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.pos = 0
        self.waits = 0  # spans whose copy had not run when the ring came round to them
        self._inflight: deque[tuple[int, int, Any]] = deque()  # (start, end, event), oldest first
        self._spare: list[Any] = []  # events of spans done with, recorded again
        self._lock = threading.Lock()

    def send(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        n = t.numel() * t.element_size()
        if not 0 < n <= self.buf.numel() // 8:
            return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t.clone()
        with self._lock:
            start = self._claim(-(-n // self.ALIGN) * self.ALIGN)
            host = self.buf[start : start + n].view(t.dtype).view(t.shape)
            host.copy_(t)
            out, event = self._copy(host)
            if event is not None:
                self._inflight.append((start, start + n, event))
            return out

    def _copy(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` (a span of the ring) to the device: (the copy, an event that
        completes once the span has been read; None: read already)."""
        if not self.cuda:
            return host.clone(), None
        out = host.to(self.device, non_blocking=True)
        event = self._spare.pop() if self._spare else torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return out, event

    def _claim(self, size: int) -> int:
        """The start of the next ``size`` bytes, free to write (hold ``_lock``). Spans are
        taken in address order, so the oldest copies in flight read the spans written next:
        on a wrap, first those in the tail it skips, then those under the new span."""
        if self.pos + size > self.buf.numel():
            while self._inflight and self._inflight[0][0] >= self.pos:
                self._retire(wait=True)
            self.pos = 0
        start, end = self.pos, self.pos + size
        while self._inflight:
            s, e, event = self._inflight[0]
            if s < end and start < e:  # the copy that reads this span must have run
                self._retire(wait=True)
            elif event.query():
                self._retire(wait=False)
            else:
                break
        self.pos = end
        return start

    def _retire(self, wait: bool) -> None:
        """Forget the oldest copy in flight, once it has run (waiting for it if ``wait``)."""
        _, _, event = self._inflight.popleft()
        if wait and not event.query():
            self.waits += 1
            event.synchronize()
        self._spare.append(event)


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
