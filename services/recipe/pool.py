"""The recipe's encoding pool: request parsing, conversion, rendering and tokenization run here,
never on the event loop.

A 4 MiB prompt holds a CPU for seconds (json, the library's conversion, the renderer, the
tokenizer); on the loop that froze ``/healthz`` and every stream for 3.9 s. The pool has
``--encode-threads`` threads and admits at most ``--encode-queue`` more jobs waiting for one;
beyond that a request is refused at once as :class:`~libs.common.errors.Overloaded` (429 with
Retry-After in the caller's protocol) rather than queueing without bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from libs.common.errors import Overloaded

T = TypeVar("T")


class EncodePool:
    """A bounded thread pool for CPU work of requests. ``run`` from the event loop only."""

    def __init__(self, threads: int, queue: int, retry_after_ms: int = 1000) -> None:
        if threads <= 0:
            raise ValueError(f"--encode-threads must be positive, got {threads}")
        if queue < 0:
            raise ValueError(f"--encode-queue must be >= 0, got {queue}")
        self.threads, self.queue, self.retry_after_ms = threads, queue, retry_after_ms
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="recipe-encode"
        )
        self.busy = 0  # jobs running or waiting; counted until the thread is done with them

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a pool thread. Overloaded when ``threads + queue`` jobs are in. A job
        whose caller goes away still holds its slot until its thread finishes (a thread cannot
        be stopped), so abandoned work cannot pile up beyond the bound either."""
        if self.busy >= self.threads + self.queue:
            raise Overloaded(
                f"{self.busy} requests are being parsed and tokenized (--encode-threads "
                f"{self.threads}, --encode-queue {self.queue})",
                self.retry_after_ms,
            )
        loop = asyncio.get_running_loop()
        self.busy += 1
        try:
            fut = self._executor.submit(fn)
        except BaseException:
            self.busy -= 1
            raise

        def release(_: concurrent.futures.Future[T]) -> None:
            try:
                loop.call_soon_threadsafe(self._release)
            except RuntimeError:  # the loop closed meanwhile: nobody counts any more
                pass

        fut.add_done_callback(release)
        return await asyncio.wrap_future(fut)

    def _release(self) -> None:
        self.busy -= 1

    def close(self) -> None:
        """Drop queued jobs; running ones finish on their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)
