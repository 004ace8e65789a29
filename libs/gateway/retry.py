"""When a request's instance fails, what the entrypoint does next. No I/O.

A request is served in attempts; each has its own upstream id, its own prefill and decode
instance. When an attempt fails with a retryable error (an instance's error event, or an
instance that stopped heartbeating), :func:`decide` picks:

* ``FRESH`` -- nothing reached the client yet: run the request again on other instances
  (the kvstore still holds the blocks the failed prefill wrote, so the prompt is not
  recomputed from scratch);
* ``CONTINUE`` -- tokens were sent: resume the same request. The PrefillTask carries
  ``prompt + tokens sent`` with ``num_prior_outputs`` = tokens sent and the request's own
  sampling settings: the engines take those tokens as output already produced (the grammar
  is advanced past them, the penalties count them, ``max_tokens`` and ``min_tokens`` count
  the whole completion, seeded draws stay keyed by (seed, position),
  ``libs/engine/sampler.py``), so for greedy and seeded sampling the client sees exactly the
  uninterrupted completion;
* ``FAIL`` -- not retryable, out of attempts, or tokens were sent under unseeded sampling
  (the resumed attempt's draws would not be those the failed instance would have made): the
  client gets UNAVAILABLE and retries.

:class:`Progress` is what survives between attempts: tokens sent, Ready sent, cached tokens,
instances to exclude; it turns one attempt's outputs into what the client sees.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from libs.common.errors import InstanceFailed

from .policy import Finish, Output, Ready, Tokens


class Action(enum.Enum):
    FRESH = "fresh"
    CONTINUE = "continue"
    FAIL = "fail"


def exact_continuation(temperature: float, seed: int | None) -> bool:
    """Whether resending ``prompt + tokens so far`` yields the uninterrupted completion."""
    return temperature == 0 or seed is not None


def decide(
    *, retryable: bool, attempt: int, max_attempts: int, tokens_sent: int, exact: bool
) -> Action:
    """What to do after attempt number ``attempt`` (1-based) failed."""
    if not retryable or attempt >= max_attempts:
        return Action.FAIL
    if tokens_sent == 0:
        return Action.FRESH
    return Action.CONTINUE if exact else Action.FAIL


@dataclass
class Progress:
    """The client-visible state of one request across attempts."""

    prompt: tuple[int, ...]
    max_tokens: int
    sent: list[int] = field(default_factory=list)
    ready_sent: bool = False
    cached_tokens: int = 0
    excluded: list[str] = field(default_factory=list)

    @property
    def attempt_prompt(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.sent)

    @property
    def prior_outputs(self) -> int:
        """How many tokens at the end of :attr:`attempt_prompt` are output already sent."""
        return len(self.sent)

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.sent)

    def exclude(self, instances: Iterable[str]) -> None:
        for i in instances:
            if i and i not in self.excluded:
                self.excluded.append(i)

    def translate(self, out: Output) -> Output | None:
        """An attempt's output as the client sees it (None: already said)."""
        if isinstance(out, Ready):
            if self.ready_sent:
                return None
            self.ready_sent, self.cached_tokens = True, out.cached_tokens
            return Ready(len(self.prompt), out.cached_tokens)
        if isinstance(out, Tokens):
            self.sent.extend(out.token_ids)
            return out
        return Finish(
            out.reason, len(self.prompt), self.cached_tokens, len(self.sent), out.speculative
        )


class AttemptFailed(InstanceFailed):
    """One attempt ended because an instance failed (retryable); ``instances`` to avoid."""

    def __init__(self, message: str, instances: tuple[str, ...]) -> None:
        super().__init__(message)
        self.instances = instances


class Liveness(Protocol):
    def silent_for(self, instance_id: str) -> float | None:
        """Seconds since ``instance_id``'s last heartbeat; None if never heard."""


class Watch:
    """Which instances an attempt depends on, and whether one of them went silent.

    The prefill instance matters until the first decode token arrives (then the KV has been
    handed over); the decode instance until the end. An instance never heard from is given
    the time since the attempt started (the entrypoint may have started after its last beat).
    """

    def __init__(
        self,
        liveness: Liveness | None,
        prefill: str,
        decode: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.liveness, self.prefill, self.decode, self.clock = liveness, prefill, decode, clock
        self.started = clock()
        self.handed_over = False

    @property
    def serving(self) -> tuple[str, ...]:
        return (self.decode,) if self.handed_over else (self.prefill, self.decode)

    def blamed(self, index: int) -> tuple[str, ...]:
        """Whom a retryable error event at ``index`` excludes from the retry. From index 1 on
        the prefill instance has produced the first token and its KV: what failed is the
        hand-over to the decode instance or the decode itself, so only decode is avoided (a
        stack with one prefill instance would otherwise have none left to retry on)."""
        return (self.decode,) if index >= 1 else self.serving

    def saw(self, index: int) -> None:
        if index >= 1:
            self.handed_over = True

    def dead(self, after_s: float) -> str:
        """The first instance of :attr:`serving` silent for more than ``after_s``, or ""."""
        if self.liveness is None:
            return ""
        elapsed = self.clock() - self.started
        for inst in self.serving:
            silent = self.liveness.silent_for(inst)
            if min(elapsed, elapsed if silent is None else silent) > after_s:
                return inst
        return ""
