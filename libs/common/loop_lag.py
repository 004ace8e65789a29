"""How late a service's event loop runs what is due: ``deepserve_event_loop_lag_seconds``.

Every service keeps its network work on one asyncio loop; an engine service also runs its
engine on a thread of the same process. A timer that fires late says the loop could not run:
a callback ran long, or another thread held the GIL (an engine thread in eager Python holds it
most of a step, and the loop waits up to ``sys.getswitchinterval()`` for it each time it wants
it back). Whatever the loop does next -- taking a task off NATS, sending a token -- is late by
as much, so this histogram is where a first token's wait above the engine shows up.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

PERIOD_S = 0.02  # one timer a 50th of a second: ~50 wake-ups a second, nothing measurable

LAG = Histogram(
    "deepserve_event_loop_lag_seconds",
    "How late the service's event loop woke a timer due every 20 ms (long callbacks, or "
    "another thread of the process holding the GIL)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)


async def watch_loop_lag(period_s: float = PERIOD_S) -> None:
    """Observe the running loop's lag every ``period_s`` until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        LAG.observe(max(0.0, loop.time() - due))
