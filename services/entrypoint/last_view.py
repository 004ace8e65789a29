"""Routing while no balancer answers: the entrypoint's own view of the instances.

The entrypoint hears every heartbeat already (admission and liveness read them). It also keeps
them in the balancer's own policy (``libs/routing/policy.py``, default settings), and when no
balancer answers a route request -- nobody subscribed (killed, restarting, warming up) or no
answer within ``--route-timeout`` (hung) -- :class:`Upstream` routes on that view instead of
failing the request with UNAVAILABLE. Before, a killed balancer that its supervisor had back
in 1.5 s meant 9 s of 503s.

Staleness is bounded by the heartbeats: an instance silent for ``instance_dead_after`` (3 s)
is never chosen, so with no heartbeats at all (NATS gone) the view routes nothing and the
request fails as before. Locality and load follow the balancer's rules; the length-bucket
assignment and the recent-work figures are this entrypoint's own. A balancer's answer, even
"no instance", always wins over the view: while it answers, the view only listens.

While the balancer is away, a request routes at once on the view and, at most every
``probe_every`` seconds, one also asks the balancer in the background (so a hung balancer
costs no request its route timeout); the first answer ends the outage. That probe's decision
is not used (the balancer counts it as routed work: one request at most every 0.5 s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from libs.proto.deepserve.v1 import control_pb2
from libs.routing.heartbeat import decision_message, instance_from_status, route
from libs.routing.policy import NoInstance, RoutingPolicy

log = logging.getLogger("entrypoint")
PROBE_EVERY_S = 0.5  # while away, how often a request also asks the balancer


class LastView:
    """The instances this entrypoint heard, and whether the balancer is away.

    :meth:`observe` every heartbeat; :meth:`route` a request on the view (None: nothing live
    can take it); :meth:`away_now` when a balancer did not answer, :meth:`answered` when one
    did; :meth:`probe_due` says whether an outage's request should also ask the balancer.
    """

    def __init__(
        self,
        dead_after: float,
        probe_every: float = PROBE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = RoutingPolicy(heartbeat_timeout=dead_after, clock=clock)
        self.probe_every, self._clock = probe_every, clock
        self.away_since: float | None = None  # when a balancer last failed to answer
        self._probed_at = float("-inf")
        self.routed_here = 0  # requests routed on the view during the current outage

    @property
    def away(self) -> bool:
        return self.away_since is not None

    def observe(self, status: control_pb2.InstanceStatus) -> None:
        try:
            self.policy.observe(instance_from_status(status))
        except ValueError:
            return  # admission logs unreadable heartbeats already

    def route(self, req: control_pb2.RouteRequest) -> control_pb2.RouteDecision | None:
        self.policy.prune()
        try:
            decision = route(self.policy, req)
        except NoInstance:
            return None
        self.routed_here += 1
        return decision_message(decision)

    def away_now(self, why: str) -> None:
        now = self._clock()
        if self.away_since is None:
            self.away_since, self.routed_here = now, 0
            live = len(self.policy.live())
            log.warning(
                "no balancer answers (%s): routing on this entrypoint's view of %d live "
                "instances until one does",
                why,
                live,
            )
        self._probed_at = now

    def answered(self) -> None:
        if self.away_since is None:
            return
        log.warning(
            "a balancer answers again after %.1fs; %d requests were routed here meanwhile",
            self._clock() - self.away_since,
            self.routed_here,
        )
        self.away_since = None

    def probe_due(self) -> bool:
        """Whether this request should also ask the balancer (at most every probe_every s)."""
        now = self._clock()
        if now - self._probed_at < self.probe_every:
            return False
        self._probed_at = now
        return True
