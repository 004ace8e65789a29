"""Who calls ``Generate``, what their key may use, and what the call is billed.

* :class:`CredentialInterceptor` refuses a call without a valid credential from its metadata
  alone, before the request body is read (a stranger's bytes are never parsed).
* :meth:`Callers.authenticate` decides the tenant: an API key's own (whatever the request
  says), or the request's when the caller is the service (the recipe, which authenticated its
  client and enforces that client's key limits itself). The service caller also says, in
  :class:`~libs.common.grpc_auth.OnBehalf` metadata, which key id and protocol route the call
  serves, so the usage record names them; from an API-key caller that metadata is ignored.
* :meth:`Callers.admit` holds the key's limits for an API-key caller (``libs/transport/
  keycaps.py``, shared with the recipe replicas through Redis: one key, one cap, on HTTP and
  gRPC alike): one generation of concurrency and ``prompt + max_tokens`` of its token rate;
  a refusal is RESOURCE_EXHAUSTED naming the limit, with ``retry-after-ms``.
* :class:`CallAccount` writes the call's usage record (``ledger.py``) and gives the key's
  slot back when the call ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from libs.common.auth import KeyTable
from libs.common.errors import InvalidArgument, Overloaded, Unauthenticated
from libs.common.grpc_auth import OnBehalf, bearer, same_token, unread
from libs.gateway.keylimits import Refusal, Slot, key_id
from libs.gateway.policy import ValidRequest
from libs.proto.deepserve.v1 import generate_pb2
from libs.transport.keycaps import KeyCaps

from .handler_config import HandlerConfig
from .ledger import Ledger, Opened

GENERATE = "/deepserve.v1.Generate/"


@dataclass(frozen=True)
class Caller:
    """An authenticated call: the request as it may be served (tenant set), the key id and
    route its usage record names, and whether the key's limits are held here (``capped``: an
    API key presented here; the service caller caps its own clients)."""

    request: generate_pb2.GenerateRequest
    key_id: str = ""  # the API key's id; the service caller's client's ("": none)
    route: str = "service"  # grpc (an API key here), the service caller's route, or service
    capped: bool = False


class Callers:
    def __init__(self, config: HandlerConfig, caps: KeyCaps) -> None:
        self.config, self.caps = config, caps
        self.keys = KeyTable(dict(config.api_keys))

    def credential_ok(self, metadata: Any) -> bool:
        """Whether the metadata carries a credential this entrypoint takes (or none is needed)."""
        cfg = self.config
        if not cfg.api_keys and not cfg.service_token:
            return True
        presented = bearer(metadata or ())
        if same_token(presented, cfg.service_token):
            return True
        return presented is not None and self.keys.tenant_of(presented) is not None

    def refusal(self, presented: str | None) -> Unauthenticated:
        return Unauthenticated(
            "Generate needs a credential: authorization: Bearer <API key>"
            + (" or the service token" if self.config.service_token else "")
            + ("" if presented is None else " (the one presented is not valid)")
        )

    def authenticate(self, request: generate_pb2.GenerateRequest, context: Any) -> Caller:
        """The request as this caller may send it; raises Unauthenticated."""
        cfg = self.config
        metadata = context.invocation_metadata() or ()
        if not cfg.api_keys and not cfg.service_token:
            return _for_service(request, metadata)  # open (local use): said at start
        presented = bearer(metadata)
        if same_token(presented, cfg.service_token):
            return _for_service(request, metadata)
        if cfg.api_keys and presented is not None:
            tenant = self.keys.tenant_of(presented)
            if tenant is not None:
                kid = key_id(presented)
                if request.tenant == tenant:
                    return Caller(request, kid, "grpc", capped=True)
                out = generate_pb2.GenerateRequest()
                out.CopyFrom(request)
                out.tenant = tenant
                return Caller(out, kid, "grpc", capped=True)
        raise self.refusal(presented)

    async def admit(self, caller: Caller, valid: ValidRequest) -> Slot | None:
        """The key's slot for an API-key caller (None for others); raises Overloaded."""
        if not caller.capped:
            return None
        got = await self.caps.enter(caller.key_id)
        if isinstance(got, Refusal):
            raise _overloaded(got)
        refusal = await self.caps.reserve(
            got, len(valid.prompt_token_ids) + valid.sampling.max_tokens
        )
        if refusal is not None:
            await self.caps.leave(got, None)
            raise _overloaded(refusal)
        return got


def _for_service(request: generate_pb2.GenerateRequest, metadata: Any) -> Caller:
    """The service caller's call, with the key id and route it names (OnBehalf metadata)."""
    try:
        on = OnBehalf.from_metadata(metadata)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return Caller(request, on.key_id, on.route or "service")


def _overloaded(refusal: Refusal) -> Overloaded:
    return Overloaded(
        f"{refusal.message}; retry in {refusal.retry_after_s} s", refusal.retry_after_s * 1000
    )


class CallAccount:
    """One call's usage record and key slot. :meth:`ready` when ``Ready`` goes out,
    :meth:`delivering` before each ``Tokens`` event (the total the client will have),
    :meth:`end` once (idempotent)."""

    def __init__(
        self,
        ledger: Ledger | None,
        caps: KeyCaps,
        caller: Caller,
        valid: ValidRequest,
        rid: str,
        slot: Slot | None,
        spawn: Callable[[Awaitable[None]], None],
    ) -> None:
        self.ledger, self.caps, self.caller, self.valid, self.rid = ledger, caps, caller, valid, rid
        self.slot, self.spawn = slot, spawn
        self.name: str | None = None
        self.prompt_tokens = self.completion_tokens = 0
        self.ended = False

    async def ready(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        if self.ledger is None or self.name is not None:
            return
        self.name = await self.ledger.open(
            Opened(
                request_id=self.rid,
                tenant=self.valid.tenant,
                key_id=self.caller.key_id,
                model=self.valid.model,
                route=self.caller.route,
                prompt_tokens=prompt_tokens,
                cached_tokens=cached_tokens,
            )
        )

    async def delivering(self, total: int) -> None:
        self.completion_tokens = total
        if self.ledger is not None and self.name is not None:
            await self.ledger.delivered(self.name, total)

    def end(self, status: str) -> None:
        if self.ended:
            return
        self.ended = True
        if self.ledger is not None and self.name is not None:
            self.ledger.close(self.name, status, self.completion_tokens)
        if self.slot is not None:
            used = self.prompt_tokens + self.completion_tokens if self.prompt_tokens else None
            self.spawn(self.caps.leave(self.slot, used))


class CredentialInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses ``Generate`` without a credential it takes, from the metadata alone: the refusing
    handler's deserializer does not parse the body."""

    def __init__(self, callers: Callers) -> None:
        self.callers = callers

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(GENERATE):
            return handler
        if self.callers.credential_ok(details.invocation_metadata):
            return handler
        message = str(self.callers.refusal(bearer(details.invocation_metadata or ())))

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        return grpc.unary_stream_rpc_method_handler(refuse, unread, handler.response_serializer)
