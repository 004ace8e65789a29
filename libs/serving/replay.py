"""What a decode instance published per request, so the events can be sent again. No I/O.

Token events travel on core NATS, which keeps nothing: a client buffers what it publishes while
cut off and sends it once it is back, but a restarted server drops it if the entrypoint has not
resubscribed yet (measured, 3 s nats-server outage: decode was back 0.5 s before the entrypoint,
its ~200 buffered events per stream went nowhere, the index gap then held every later event,
and each stream hung until its deadline). The entrypoint notices the hole (a gap in the
indices, or a reconnection) and asks the decode instance over gRPC (``KVTransfer.Resend``) for
the events from the first missing position; :class:`EventLog` is what it answers from.

A request is kept while it decodes and for ``grace_s`` after its last event (the entrypoint
asks within a second or two of NATS being back), at most ``max_ended`` ended ones (the oldest
go first); a request the client aborted is forgotten at once. A token costs 4 bytes here.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.common.sampling import TokenLogprob
from libs.proto.deepserve.v1 import control_pb2


@dataclass
class _Sent:
    prompt_tokens: int
    cached_tokens: int
    tokens: array[int] = field(default_factory=lambda: array("i"))  # output position 0 on
    finished: bool = False
    finish_reason: str = ""
    error: control_pb2.TokenEvent | None = None
    logprobs: list[TokenLogprob | None] | None = None  # per position, when the request asked


class EventLog:
    def __init__(
        self,
        grace_s: float = 30.0,
        max_ended: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if grace_s < 0 or max_ended < 0:
            raise ValueError("grace_s and max_ended must be >= 0")
        self.grace_s, self.max_ended, self.clock = grace_s, max_ended, clock
        self._live: dict[str, _Sent] = {}
        self._ended: OrderedDict[str, tuple[float, _Sent]] = OrderedDict()  # by end time

    def start(
        self,
        rid: str,
        first_token: int,
        prompt_tokens: int,
        cached_tokens: int,
        first_logprobs: TokenLogprob | None = None,
        with_logprobs: bool = False,
    ) -> None:
        """Decoding begins; prefill already published ``first_token`` as position 0.
        ``with_logprobs``: the request asked for them (kept per position from here)."""
        sent = _Sent(prompt_tokens, cached_tokens)
        sent.tokens.append(first_token)
        if with_logprobs:
            sent.logprobs = [first_logprobs]
        self._live[rid] = sent

    def token(
        self,
        rid: str,
        token_id: int,
        finished: bool,
        finish_reason: str,
        logprobs: TokenLogprob | None = None,
    ) -> None:
        """The next position was published (1, 2, ... in order)."""
        sent = self._live[rid]
        sent.tokens.append(token_id)
        if sent.logprobs is not None:
            sent.logprobs.append(logprobs)
        sent.finished, sent.finish_reason = finished, finish_reason

    def error(self, rid: str, event: control_pb2.TokenEvent) -> None:
        """The request ended with this error event."""
        if rid in self._live:
            self._live[rid].error = event

    def end(self, rid: str) -> None:
        """Nothing more will be published for ``rid``: keep it for ``grace_s``."""
        sent = self._live.pop(rid, None)
        if sent is None:
            return
        self._expire()
        if self.grace_s > 0 and self.max_ended > 0:
            self._ended[rid] = (self.clock(), sent)
            while len(self._ended) > self.max_ended:
                self._ended.popitem(last=False)

    def drop(self, rid: str) -> None:
        """The client aborted: nobody will ask again."""
        self._live.pop(rid, None)
        self._ended.pop(rid, None)

    def since(self, rid: str, from_index: int) -> list[control_pb2.TokenEvent] | None:
        """The events from position ``from_index`` on: one event with every token from there
        (finished if the request is; none if there are no such tokens and it has not finished)
        and the error event it ended with, if any. None: ``rid`` is not known here."""
        self._expire()
        sent = self._live.get(rid)
        if sent is None and rid in self._ended:
            sent = self._ended[rid][1]
        if sent is None:
            return None
        start = max(0, from_index)
        out: list[control_pb2.TokenEvent] = []
        if start < len(sent.tokens) or sent.finished:
            start = min(start, len(sent.tokens))
            ev = control_pb2.TokenEvent(
                request_id=rid,
                index=start,
                token_ids=sent.tokens[start:].tolist(),
                finished=sent.finished,
                finish_reason=sent.finish_reason,
                prompt_tokens=sent.prompt_tokens,
                cached_tokens=sent.cached_tokens,
            )
            lps = sent.logprobs[start:] if sent.logprobs is not None else []
            if lps and all(lp is not None for lp in lps):  # one per token, or none at all
                ev.logprobs.extend(lp.to_proto() for lp in lps if lp is not None)
            out.append(ev)
        if sent.error is not None:
            out.append(sent.error)
        return out

    def __len__(self) -> int:
        return len(self._live) + len(self._ended)

    def _expire(self) -> None:
        cutoff = self.clock() - self.grace_s
        while self._ended:
            rid, (ended_at, _) = next(iter(self._ended.items()))
            if ended_at > cutoff:
                break
            del self._ended[rid]
