"""Remember recent request ids: on NATS an abort can overtake the work it cancels, and a
task sent again (the entrypoint repeats a PrefillTask until one copy is confirmed) can
arrive after the first copy."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

ABORT_MEMORY_S = 120.0  # an abort can overtake its request's KV push; remember it this long
ABORT_MEMORY_MAX = 100_000


class RecentIds:
    """Request ids added within the last ``ttl_s`` seconds, at most ``max_size`` of them
    (the oldest are forgotten first)."""

    def __init__(
        self,
        ttl_s: float = ABORT_MEMORY_S,
        max_size: int = ABORT_MEMORY_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.max_size, self._clock = ttl_s, max_size, clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._seen[request_id] = self._clock()
        self._seen.move_to_end(request_id)
        self._trim()

    def __contains__(self, request_id: object) -> bool:
        self._trim()
        return request_id in self._seen

    def __len__(self) -> int:
        self._trim()
        return len(self._seen)

    def _trim(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._seen and (
            len(self._seen) > self.max_size or next(iter(self._seen.values())) < cutoff
        ):
            self._seen.popitem(last=False)


class RecentAborts(RecentIds):
    """Request ids aborted lately, so work that arrives after its abort is refused."""
