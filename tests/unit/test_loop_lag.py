"""The event-loop lag histogram sees a loop that could not run (what hides a GIL-bound engine
thread's cost to a service's network work)."""

from __future__ import annotations

import asyncio
import time

from libs.common.loop_lag import LAG, watch_loop_lag


def _lag_sum() -> float:
    return next(s.value for s in LAG.collect()[0].samples if s.name.endswith("_sum"))


def test_a_blocked_loop_shows_as_lag() -> None:
    async def run() -> tuple[float, float]:
        watcher = asyncio.create_task(watch_loop_lag(0.005))
        await asyncio.sleep(0.05)
        calm = _lag_sum()
        await asyncio.sleep(0.006)
        time.sleep(0.2)  # the loop cannot run: a callback holding it, or the GIL held elsewhere
        await asyncio.sleep(0.05)
        watcher.cancel()
        return calm, _lag_sum()

    before = _lag_sum()
    calm, after = asyncio.run(run())
    assert calm - before < 0.05  # a free loop wakes its timers about on time
    assert after - calm >= 0.15  # the 0.2 s it could not run
