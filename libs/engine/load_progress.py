"""How far a checkpoint load has got, as the loaders report it (torch-free: the services and
the status page's feed read it without importing the engine).

The V3 and V4 loaders (``loader.py``, ``v4/load.py``) call a :data:`ProgressSink` once before
the first shard (nothing done yet) and once after each shard is placed, from the thread that
loads; the last call has ``shards_done == shards_total``. A preset (random weights, nothing
read) makes no call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadProgress:
    """One point of a load. ``bytes_done``/``bytes_total`` count the shard files' sizes (what
    the fraction and the ETA are taken over); ``bytes_read`` counts the bytes actually read
    from them (an expert-parallel rank reads only its own experts' part)."""

    source: str  # the checkpoint directory's name
    shards_done: int
    shards_total: int
    bytes_done: int
    bytes_total: int
    bytes_read: int
    seconds: float  # since the load began

    @property
    def fraction(self) -> float:
        """Share of the checkpoint's bytes behind us, 0..1 (1 for an empty checkpoint)."""
        if self.bytes_total <= 0:
            return 1.0 if self.shards_done >= self.shards_total else 0.0
        return min(1.0, self.bytes_done / self.bytes_total)

    @property
    def read_bytes_per_s(self) -> float:
        """Bytes read per second so far (0 before the first shard)."""
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the pace so far; None before the first shard is done."""
        if self.bytes_done <= 0 or self.seconds <= 0:
            return None
        return max(0.0, (self.bytes_total - self.bytes_done) * self.seconds / self.bytes_done)

    @property
    def done(self) -> bool:
        return self.shards_done >= self.shards_total


ProgressSink = Callable[[LoadProgress], None]
