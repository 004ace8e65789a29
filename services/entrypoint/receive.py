"""One attempt's token events: the next chunk from the bus, or -- after a NATS reconnection or a
gap in the indices -- the events the decode instance resends (``libs/serving/replay.py``);
a silent instance becomes :class:`~libs.gateway.retry.AttemptFailed`, silence past the request
timeout :class:`~libs.common.errors.DeadlineExceeded`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from prometheus_client import Counter

from libs.common.errors import DeadlineExceeded, Internal, InvalidArgument
from libs.common.sampling import TokenLogprob
from libs.gateway.policy import Chunk, RequestStream
from libs.gateway.retry import AttemptFailed, Watch
from libs.proto.deepserve.v1 import control_pb2

from .contracts import Resender, ResendFailed, Subscription
from .handler_config import HandlerConfig

log = logging.getLogger("entrypoint")

RESENT = Counter(
    "deepserve_entrypoint_resent_tokens_total",
    "tokens lost on the bus and sent again by decode instances (a NATS outage)",
)


@dataclass
class Refill:
    """One attempt's watch for lost token events: after a bus reconnection, or when a gap
    in the indices outlives ``liveness_poll``, the decode instance is asked for the events
    from the first missing position (at most once per ``liveness_poll``)."""

    address: str
    reconnects: int  # bus reconnections already accounted for
    gap_since: float | None = None
    asked_at: float = float("-inf")
    queued: list[control_pb2.TokenEvent] = field(default_factory=list)


class EventReader:
    """Reads one attempt's events under ``config``'s deadlines; ``resender``: where lost events
    come back from (None: nothing is asked again)."""

    def __init__(self, config: HandlerConfig, resender: Resender | None) -> None:
        self.config, self.resender = config, resender

    async def next_chunk(
        self,
        sub: Subscription,
        rid: str,
        watch: Watch,
        stream: RequestStream,
        refill: Refill | None,
    ) -> Chunk:
        timeout = self.config.request_timeout
        silent_since = time.monotonic()
        while True:
            if refill is not None:
                if not refill.queued and self._refill_due(refill, stream):
                    await self._refill(refill, rid, stream)
                if refill.queued:
                    return self._chunk(refill.queued.pop(0), rid, watch)
            waited = time.monotonic() - silent_since
            if waited >= timeout:
                raise DeadlineExceeded(
                    f"request {rid}: no token for {timeout:g}s from the serving instances; aborted"
                )
            try:
                data = await sub.next(min(timeout - waited, self.config.liveness_poll))
            except TimeoutError:
                dead = watch.dead(self.config.instance_dead_after)
                if dead:
                    raise AttemptFailed(
                        f"instance {dead} stopped heartbeating "
                        f"(silent > {self.config.instance_dead_after:g}s)",
                        (dead,),
                    ) from None
                continue
            try:
                ev = control_pb2.TokenEvent.FromString(data)
            except DecodeError:
                log.warning("request %s: unreadable token event ignored", rid)
                continue
            return self._chunk(ev, rid, watch)

    @staticmethod
    def _chunk(ev: control_pb2.TokenEvent, rid: str, watch: Watch) -> Chunk:
        if ev.error:
            if ev.retryable:
                raise AttemptFailed(ev.error, watch.blamed(ev.index))
            if ev.invalid_argument:  # the request itself was refused (e.g. a grammar's limit)
                raise InvalidArgument(f"request {rid} refused: {ev.error}")
            raise Internal(f"request {rid} failed: {ev.error}")
        return Chunk(
            ev.index,
            tuple(ev.token_ids),
            ev.finished,
            ev.finish_reason,
            ev.prompt_tokens,
            ev.cached_tokens,
            tuple(TokenLogprob.from_proto(lp) for lp in ev.logprobs),
            (ev.speculative.drafted, ev.speculative.verified, ev.speculative.accepted)
            if ev.HasField("speculative")
            else (),
        )

    def _refill_due(self, refill: Refill, stream: RequestStream) -> bool:
        """Whether to ask the decode instance for lost events now: the bus reconnected since
        we last asked, or a gap in the indices has lasted ``liveness_poll`` (events from one
        publisher arrive in order; prefill's and decode's may cross, but not for that long)."""
        assert self.resender is not None
        now, poll = time.monotonic(), self.config.liveness_poll
        if not stream.buffer.pending:
            refill.gap_since = None
        elif refill.gap_since is None:
            refill.gap_since = now
        if now - refill.asked_at < poll:
            return False
        gap = refill.gap_since is not None and now - refill.gap_since >= poll
        return gap or self.resender.reconnects() > refill.reconnects

    async def _refill(self, refill: Refill, rid: str, stream: RequestStream) -> None:
        """Ask the decode instance for the events from the first position not yet released;
        what it sends joins the stream like any event (overlaps are cut off). A failed ask is
        repeated after ``liveness_poll``; the usual deadlines still apply."""
        assert self.resender is not None
        refill.asked_at = time.monotonic()
        reconnects = self.resender.reconnects()
        start = stream.buffer.next_index
        try:
            await self.resender.settle()
            events = await self.resender.resend(refill.address, rid, start)
        except ResendFailed as exc:
            log.info("request %s: cannot ask for lost token events yet (%s)", rid, exc)
            return
        refill.reconnects = reconnects
        if events is None:
            return  # not handed over to decode yet: what prefill sends still comes
        got = sum(len(ev.token_ids) for ev in events)
        lost = stream.buffer.missing(start + got)
        RESENT.inc(lost)
        log.warning(
            "request %s: asked decode for token events from position %d after %s: %d came, "
            "%d of them not received here",
            rid,
            start,
            "a gap" if stream.buffer.pending else "a NATS reconnection",
            got,
            lost,
        )
        refill.queued.extend(events)
