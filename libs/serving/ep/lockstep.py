"""The lockstep loop of an EP group's ranks, for a service that steps its engine forever.

Each :meth:`Lockstep.tick` is one round on every rank: one tiny all-reduce agrees whether any
rank has work and whether every rank is stopping; then every rank steps its engine (one
forward each, empty where a rank has nothing: the MoE exchanges pair up), or, when no rank has
work, every rank sleeps ``poll_s`` and asks again. A rank that stops (SIGTERM, drain done)
says so in the same all-reduce and keeps taking part (empty steps) while any peer still
works: its drain finishing first must not cut the requests its peers are still serving. When
every rank is stopping, the whole group leaves the loop in the same round instead of leaving
a peer waiting in a collective. A rank that is stopped alone (its peers never are) therefore
waits for them; the service's supervisor stops every rank of a group together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from libs.engine.engine import Engine
from libs.engine.scheduler import TokenEvent


@dataclass
class Tick:
    events: list[TokenEvent] = field(default_factory=list)
    stepped: bool = False  # the group ran a step this round
    stop: bool = False  # every rank is stopping: leave the loop (every rank sees it this round)


class Lockstep:
    """Drives one rank's engine; ``poll_s``: the idle group's sleep between rounds (a few
    milliseconds: the all-reduce of two integers costs ~0.1 ms on gloo over loopback)."""

    def __init__(self, engine: Engine, poll_s: float = 0.005) -> None:
        if engine.ep is None:
            raise ValueError("Lockstep drives an expert-parallel engine (Engine(ep=...))")
        self.engine = engine
        self.group = engine.ep.group
        self.poll_s = poll_s

    def tick(self, stopping: bool = False) -> Tick:
        """One round (a collective: every rank calls it once per round)."""
        work, going_on = self.group.all_max([int(self.engine.has_unfinished()), int(not stopping)])
        if not going_on:
            return Tick(stop=True)
        if not work:
            time.sleep(self.poll_s)
            return Tick()
        return Tick(self.engine.step(), stepped=True)
