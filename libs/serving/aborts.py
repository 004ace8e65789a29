"""Remember recent aborts: on NATS an abort can overtake the work it cancels."""

from __future__ import annotations

import time
from collections import OrderedDict

ABORT_MEMORY_S = 120.0  # an abort can overtake its request's KV push; remember it this long
ABORT_MEMORY_MAX = 100_000


class RecentAborts:
    """Request ids aborted lately, so work that arrives after its abort is refused."""

    def __init__(self, ttl_s: float = ABORT_MEMORY_S, max_size: int = ABORT_MEMORY_MAX) -> None:
        self.ttl_s, self.max_size = ttl_s, max_size
        self._seen: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._seen[request_id] = time.monotonic()
        self._seen.move_to_end(request_id)
        self._trim()

    def __contains__(self, request_id: object) -> bool:
        self._trim()
        return request_id in self._seen

    def _trim(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._seen and (
            len(self._seen) > self.max_size or next(iter(self._seen.values())) < cutoff
        ):
            self._seen.popitem(last=False)
