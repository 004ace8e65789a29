"""Per request: the API key's limits (``libs/gateway/keylimits.py``) and the usage record.

:meth:`Accounting.admit` takes a concurrency slot of the caller's key (429 when the key is at
its cap), :meth:`RequestAccount.reserve` takes one per generation (``n``; 429 naming the cap when
they do not fit) and reserves what the request may cost under the key's token rate (429 when the
bucket is short), and :meth:`RequestAccount.end` -- called once the answer
is over however it ended, idempotent -- frees the slot, gives back the unused reservation and
hands a :class:`~.usage.UsageRecord` to the sink when the backend had accepted the request.
With no API keys configured (an open API) there is no key and no limit; records are still
written (tenant ``""``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from prometheus_client import Counter

from libs.common.auth import KeyTable
from libs.common.tenant_label import UNSALTED, TenantLabels
from libs.gateway.keylimits import Refusal, Slot, key_id
from libs.transport.keycaps import KeyCaps

from .answer import Answer
from .api import APIError
from .usage import UsageRecord, UsageSink


def _too_many(refusal: Refusal) -> APIError:
    return APIError(
        429,
        f"{refusal.message}; retry in {refusal.retry_after_s} s",
        "rate_limit_error",
        code="rate_limit_exceeded",
        retry_after=refusal.retry_after_s,
    )


class RequestAccount:
    """One request's slot, reservation and (once Ready came) usage."""

    def __init__(
        self, owner: Accounting, route: str, rid: str, tenant: str, kid: str, slot: Slot | None
    ) -> None:
        self.owner, self.route, self.rid, self.tenant = owner, route, rid, tenant
        self.kid, self.slot = kid, slot
        self.started_at = time.time()
        self.job: Answer | None = None  # set once the request is sent to the backend
        self.ended = False

    async def reserve(self, tokens: int, generations: int = 1) -> None:
        """Hold ``generations`` (the request's ``n``) of the key's concurrency and reserve
        ``tokens`` (what it may cost) under the key's token rate; APIError 429."""
        if self.slot is None:
            return
        limiter = self.owner.limiter
        refusal = await limiter.widen(self.slot, generations)
        refusal = refusal or await limiter.reserve(self.slot, tokens)
        if refusal is not None:
            self.owner.refused(refusal, self.tenant)
            raise _too_many(refusal)

    def end(self, status: str) -> None:
        """The request is over (``ok``, ``error``, ``client_gone``); only the first call counts."""
        if self.ended:
            return
        self.ended = True
        job = self.job
        accepted = job is not None and job.accepted  # the backend's Ready came
        if self.slot is not None:
            used = job.prompt_tokens + job.answered_tokens if job and accepted else 0
            self.owner.leave(self.slot, used)
        if job is not None and accepted and self.owner.usage is not None:
            self.owner.usage.submit(
                UsageRecord(
                    request_id=self.rid,
                    tenant=self.tenant,
                    key_id=self.kid,
                    model=job.model,
                    route=self.route,
                    status=status,
                    prompt_tokens=job.prompt_tokens,
                    cached_tokens=job.cached_tokens,
                    completion_tokens=job.answered_tokens,
                    started_at=self.started_at,
                    finished_at=time.time(),
                )
            )


class Accounting:
    """``limiter``: the keys' limits, shared by every replica when it holds a Redis client
    (``libs/transport/keycaps.py``); ``labels``: what the ``limited`` counter calls a tenant."""

    def __init__(
        self,
        limiter: KeyCaps,
        keys: KeyTable,
        usage: UsageSink | None,
        limited: Counter,
        labels: TenantLabels = UNSALTED,
    ) -> None:
        self.keys, self.usage, self.limited, self.labels = keys, usage, limited, labels
        self.limiter = limiter
        self._leaving: set[asyncio.Task[None]] = set()

    def leave(self, slot: Slot, used: int | None) -> None:
        """Give the slot back without waiting (``end`` runs in finally blocks and callbacks)."""
        if not slot.shared:
            self.limiter.local.leave(slot, used)
            return
        task = asyncio.get_running_loop().create_task(self.limiter.leave(slot, used))
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    def refused(self, refusal: Refusal, tenant: str) -> None:
        self.limited.labels(refusal.reason, self.labels(tenant)).inc()

    async def admit(
        self, headers: Mapping[str, str], route: str, rid: str, tenant: str
    ) -> RequestAccount:
        """The request's account, holding a slot of its key; APIError 429 when the key is at
        its concurrency cap. ``tenant``: the authenticated tenant ("" on an open API)."""
        if self.keys.open:
            return RequestAccount(self, route, rid, tenant, "", None)
        presented = KeyTable.presented(headers)
        assert presented is not None, "admit after authentication"
        kid = key_id(presented)
        got = await self.limiter.enter(kid)
        if isinstance(got, Refusal):
            self.refused(got, tenant)
            raise _too_many(got)
        return RequestAccount(self, route, rid, tenant, kid, got)
