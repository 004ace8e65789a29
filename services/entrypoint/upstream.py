"""The entrypoint's calls upstream for one attempt: the tenant's cache salt and the prompt's
block names, the kvstore lookup, the balancer's route (while no balancer answers, this
entrypoint's own, ``last_view.py``), the PrefillTask to the chosen prefill instance and the
abort of an attempt given up. Everything goes through the handler's two seams,
:class:`~.contracts.Bus` and :class:`~.contracts.PrefixLookup`, so tests drive it with
in-process fakes."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import cast

from google.protobuf.message import DecodeError

from libs.common import subjects
from libs.common.errors import Internal, Unavailable
from libs.common.hashchain import chain_hashes, tenant_salt
from libs.gateway.policy import ValidRequest, lookup_prefix
from libs.proto.deepserve.v1 import control_pb2

from .contracts import Bus, LookupFailed, PrefixLookup
from .delivery import TaskSender, deliver
from .handler_config import HandlerConfig
from .last_view import LastView
from .metrics import BALANCER_AWAY, LOCAL_ROUTES, LOOKUP_ERRORS, TASK_COPIES

log = logging.getLogger("entrypoint")

# Route requests carry the leading chain digests for cache-aware routing; 256 blocks (32K
# tokens, 8 KiB) say where a prompt's prefix lives without shipping a 160K-token chain.
MAX_ROUTE_HASHES = 256
# Between two route requests answered "no instance" just after a NATS outage (heartbeats
# come every 1 s; the bus settles for 3 s).
ROUTE_RETRY_PAUSE_S = 0.25
# Hash long prompts off the event loop: 160K tokens take ~20 ms of SHA-256 and packing.
INLINE_HASH_TOKENS = 16384


class Upstream:
    """``tasks``: the bus's confirmed task delivery (None: tasks are published once -- an
    in-process bus loses none)."""

    def __init__(
        self, config: HandlerConfig, bus: Bus, kv: PrefixLookup, tasks: TaskSender | None
    ) -> None:
        self.config, self.bus, self.kv, self.tasks = config, bus, kv, tasks
        self._salt_secret = config.salt_secret or secrets.token_bytes(32)
        if not config.salt_secret:
            log.warning(
                "no --cache-salt-secret: tenants' cache names use a random secret of this "
                "process (cached prefixes will not survive a restart or match other entrypoints)"
            )
        self._salts: dict[str, bytes] = {}
        # the instances heard in heartbeats, routed on while no balancer answers
        self.view = LastView(config.instance_dead_after)
        self._probes: set[asyncio.Task[None]] = set()

    def salt(self, tenant: str) -> bytes:
        """The tenant's cache salt: a keyed hash, never the tenant's name."""
        salt = self._salts.get(tenant)
        if salt is None:
            if len(self._salts) >= 65_536:
                self._salts.clear()
            salt = self._salts[tenant] = tenant_salt(self._salt_secret, tenant)
        return salt

    async def hashes(self, prompt: tuple[int, ...], salt: bytes) -> list[bytes]:
        size = self.config.limits.block_size
        prefix = prompt[: lookup_prefix(len(prompt), size)]
        if len(prefix) <= INLINE_HASH_TOKENS:
            return chain_hashes(prefix, size, salt=salt)
        return await asyncio.to_thread(chain_hashes, prefix, size, salt)

    async def lookup(self, rid: str, hashes: list[bytes]) -> int:
        if not hashes:
            return 0
        try:
            return await self.kv.lookup(hashes)
        except LookupFailed:
            LOOKUP_ERRORS.inc()
            return 0

    async def route(
        self,
        valid: ValidRequest,
        rid: str,
        prompt_tokens: int,
        hashes: list[bytes],
        cached_blocks: int,
        exclude: list[str],
        avoid: tuple[str, ...] = (),
    ) -> control_pb2.RouteDecision:
        """Ask a balancer; ``avoid`` (instances admission found full) is excluded too, unless
        the balancer then finds nothing (its view of the instances may differ from ours)."""
        req = control_pb2.RouteRequest(
            request_id=rid,
            model=valid.model,
            prompt_tokens=prompt_tokens,
            cached_blocks=cached_blocks,
            block_hashes=hashes[:MAX_ROUTE_HASHES],
            exclude=[*exclude, *(i for i in avoid if i not in exclude)],
        )
        decision = await self._decide(req)
        if (decision.error or not decision.prefill_instance) and len(req.exclude) > len(exclude):
            del req.exclude[:]
            req.exclude.extend(exclude)
            decision = await self._decide(req)
        while (decision.error or not decision.prefill_instance) and self._bus_settling():
            # Just after a NATS outage the balancer has not heard the instances again yet
            # (heartbeats every 1 s): ask again while the bus settles (a few seconds).
            await asyncio.sleep(ROUTE_RETRY_PAUSE_S)
            decision = await self._decide(req)
        if decision.error or not decision.prefill_instance:
            raise Unavailable(
                f"no instance can take the request: {decision.error or 'empty decision'}"
            )
        return decision

    async def _decide(self, req: control_pb2.RouteRequest) -> control_pb2.RouteDecision:
        """The balancer's answer; while none answers, this entrypoint's own (``last_view.py``)."""
        view = self.view
        if view.away:
            local = view.route(req)
            if local is not None:
                LOCAL_ROUTES.inc()
                if view.probe_due():  # is a balancer back? (not awaited: it may hang)
                    self._spawn_probe(req)
                return local
        try:
            decision = await self._ask_balancer(req)
        except Unavailable as exc:
            local = view.route(req)
            if local is None:
                raise
            view.away_now(str(exc))
            BALANCER_AWAY.set(1)
            LOCAL_ROUTES.inc()
            return local
        self._answered()
        return decision

    def _answered(self) -> None:
        self.view.answered()
        BALANCER_AWAY.set(0)

    def _spawn_probe(self, req: control_pb2.RouteRequest) -> None:
        async def probe() -> None:
            try:
                await self._ask_balancer(req)
            except (Unavailable, Internal):
                return
            self._answered()

        task = asyncio.get_running_loop().create_task(probe())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def _bus_settling(self) -> bool:
        return self.tasks is not None and self.tasks.settling()

    async def _ask_balancer(self, req: control_pb2.RouteRequest) -> control_pb2.RouteDecision:
        try:
            reply = await self.bus.request(
                subjects.ROUTE, req.SerializeToString(), self.config.route_timeout
            )
        except Unavailable as exc:
            raise Unavailable(f"no balancer answered ({exc}); retry in a few seconds") from None
        try:
            decision = cast(control_pb2.RouteDecision, control_pb2.RouteDecision.FromString(reply))
        except DecodeError:
            raise Internal("the balancer sent an unreadable reply") from None
        return decision

    async def send_task(self, instance: str, data: bytes) -> None:
        """The PrefillTask to ``instance``: until it confirms a copy where the bus can tell
        (``delivery.py``: a task sent during a NATS outage or just after it would be lost);
        raises AttemptFailed if nothing takes the instance's tasks for instance_dead_after."""
        subject = subjects.prefill_task(instance)
        if self.tasks is None:
            await self.bus.publish(subject, data)
            return
        _, copies = await deliver(
            self.tasks,
            subject,
            data,
            instance=instance,
            ack_timeout=self.config.task_ack_timeout,
            gone_after=self.config.instance_dead_after,
        )
        TASK_COPIES.inc(copies - 1)

    async def abort(self, rid: str, reason: str) -> None:
        try:
            await self.bus.publish(
                subjects.ABORT, control_pb2.Abort(request_id=rid, reason=reason).SerializeToString()
            )
        except Exception as exc:  # noqa: BLE001 - best effort; instances also time requests out
            log.warning("request %s: could not publish abort: %s", rid, exc)
