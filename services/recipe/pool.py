"""The recipe's encoding pool: request parsing, conversion, rendering and tokenization run here,
never on the event loop.

A 4 MiB prompt holds a CPU for seconds (json, the library's conversion, the renderer, the
tokenizer); on the loop that froze ``/healthz`` and every stream for 3.9 s. The pool has
``--encode-threads`` threads (default: the cores this process may run on) and admits request
bodies up to ``--encode-queue-bytes`` in all (running or waiting for a thread); past that a
request is refused at once as :class:`~libs.common.errors.Overloaded` (429 with Retry-After in
the caller's protocol) rather than queueing without bound. The bound is in bytes, not in
requests: the work a request brings grows with its body, and a count (it was 64) refused a
burst of small requests that the CPUs would have cleared in milliseconds. A body larger than
the whole budget is still admitted when nothing else is in (else it could never run).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable
from typing import TypeVar

from libs.common.errors import Overloaded

T = TypeVar("T")
DEFAULT_QUEUE_BYTES = 256 << 20


def host_cores() -> int:
    """The CPUs this process may run on (its affinity mask; the host's count elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class EncodePool:
    """A bounded thread pool for CPU work of requests. ``run`` from the event loop only.
    ``threads`` 0: :func:`host_cores`."""

    def __init__(
        self, threads: int, queue_bytes: int = DEFAULT_QUEUE_BYTES, retry_after_ms: int = 1000
    ) -> None:
        if threads < 0:
            raise ValueError(f"--encode-threads must be >= 0 (0: every core), got {threads}")
        if queue_bytes <= 0:
            raise ValueError(f"--encode-queue-bytes must be positive, got {queue_bytes}")
        self.threads = threads or host_cores()
        self.queue_bytes, self.retry_after_ms = queue_bytes, retry_after_ms
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.threads, thread_name_prefix="recipe-encode"
        )
        self.busy = 0  # jobs running or waiting; counted until the thread is done with them
        self.bytes = 0  # their bodies' bytes

    async def run(self, fn: Callable[[], T], size: int = 0) -> T:
        """``fn()`` on a pool thread; ``size``: the bytes of the body it works on. Overloaded
        when admitting it would put more than ``queue_bytes`` in the pool. A job whose caller
        goes away still holds its bytes until its thread finishes (a thread cannot be
        stopped), so abandoned work cannot pile up beyond the bound either."""
        if self.busy and self.bytes + size > self.queue_bytes:
            raise Overloaded(
                f"{self.busy} requests ({self.bytes} bytes) are being parsed and tokenized "
                f"(--encode-threads {self.threads}, --encode-queue-bytes {self.queue_bytes})",
                self.retry_after_ms,
            )
        loop = asyncio.get_running_loop()
        self.busy += 1
        self.bytes += size
        try:
            fut = self._executor.submit(fn)
        except BaseException:
            self._release(size)
            raise

        def release(_: concurrent.futures.Future[T]) -> None:
            try:
                loop.call_soon_threadsafe(self._release, size)
            except RuntimeError:  # the loop closed meanwhile: nobody counts any more
                pass

        fut.add_done_callback(release)
        return await asyncio.wrap_future(fut)

    def _release(self, size: int) -> None:
        self.busy -= 1
        self.bytes -= size

    def close(self) -> None:
        """Drop queued jobs; running ones finish on their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)
