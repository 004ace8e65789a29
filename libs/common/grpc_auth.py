"""The internal APIs' credential on gRPC: a shared service token, sent as
``authorization: Bearer TOKEN`` metadata and checked by :class:`ServiceTokenInterceptor`.

Every RPC of a server with the interceptor needs the token -- except the standard health and
reflection services, which probes and tooling call without one (they reveal nothing). A caller
without it gets ``UNAUTHENTICATED`` before any handler runs. The token comes from
``--service-token`` (``DEEPSERVE_SERVICE_TOKEN``): the same on every service of a deployment,
known to nothing else; ``deepserve up`` makes one per stack. Without a token a server is open
(local use) and says so at start.

A front end calling with the service token on a client's behalf (the recipe) says which key and
which protocol route the call serves in :class:`OnBehalf` metadata; the entrypoint believes it
from the service caller only (``services/entrypoint/callers.py``).
"""

from __future__ import annotations

import argparse
import hmac
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from libs.common.auth import bearer_token
from libs.common.config import flag

EXEMPT = ("/grpc.health.v1.Health/", "/grpc.reflection.")
TOKEN_ENV = "DEEPSERVE_SERVICE_TOKEN"
KEY_ID_METADATA = "x-deepserve-key-id"
ROUTE_METADATA = "x-deepserve-route"
_KEY_ID = re.compile(r"[0-9a-f]{8,64}")  # libs/gateway/keylimits.py: key_id
_ROUTE = re.compile(r"[a-z][a-z0-9_]{0,31}")


def add_service_token_flag(parser: argparse.ArgumentParser) -> None:
    flag(
        parser,
        "--service-token",
        default="",
        env=TOKEN_ENV,
        help="shared credential of the internal APIs (kvstore, KV transfer, the entrypoint "
        "for internal callers); the same on every service; pass it through the environment. "
        "Empty: the internal APIs are open (local use)",
    )


def bearer(metadata: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` entry, if any."""
    items = metadata.items() if isinstance(metadata, Mapping) else (metadata or ())
    for k, v in items:
        if k.lower() == "authorization":
            return bearer_token(str(v))
    return None


@dataclass(frozen=True)
class OnBehalf:
    """What a front end holding the service token says about the client a call serves: the
    key id of the API key it authenticated (``""``: none, an open API) and the protocol route
    (``chat_completions``, ``messages``...). Sent as call metadata beside the credential; worth
    what the caller is worth, so only the service caller is believed."""

    key_id: str = ""
    route: str = ""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple(
            (name, value)
            for name, value in ((KEY_ID_METADATA, self.key_id), (ROUTE_METADATA, self.route))
            if value
        )

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any] | Iterable[tuple[str, Any]] | None
    ) -> OnBehalf:
        """The entries of a call's metadata; ValueError names one that is malformed."""
        items = metadata.items() if isinstance(metadata, Mapping) else (metadata or ())
        found = {
            k.lower(): str(v) for k, v in items if k.lower() in (KEY_ID_METADATA, ROUTE_METADATA)
        }
        key_id, route = found.get(KEY_ID_METADATA, ""), found.get(ROUTE_METADATA, "")
        if key_id and not _KEY_ID.fullmatch(key_id):
            raise ValueError(f"metadata {KEY_ID_METADATA} must be 8-64 lowercase hex digits")
        if route and not _ROUTE.fullmatch(route):
            raise ValueError(
                f"metadata {ROUTE_METADATA} must be a lowercase word of at most 32 characters"
            )
        return cls(key_id, route)


ANONYMOUS = OnBehalf()


def same_token(presented: str | None, expected: str) -> bool:
    return (
        bool(expected)
        and presented is not None
        and hmac.compare_digest(presented.encode(), expected.encode())
    )


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """What a client sends with each call (nothing without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class ServiceTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, token: str, exempt: tuple[str, ...] = EXEMPT) -> None:
        if not token:
            raise ValueError("a service token interceptor needs a token")
        self.token, self.exempt = token, exempt

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self.exempt):
            return handler
        presented = bearer(handler_call_details.invocation_metadata)
        if same_token(presented, self.token):
            return handler
        why = (
            "this internal API needs the service credential (authorization: Bearer "
            "<--service-token>)"
            if presented is None
            else "the service credential presented is not this deployment's"
        )
        return _refusing(handler, f"{method}: {why}")


def unread(data: bytes) -> None:
    """The deserializer of a refused call: its body is never parsed (a stranger's bytes reach
    no protobuf parser; the handler answers without reading them)."""
    return None


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED without reading anything: its
    deserializer is :func:`unread`, not the method's, so the body is never parsed."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    des, ser = unread, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, des, ser)
    return grpc.unary_unary_rpc_method_handler(unary, des, ser)


def server_interceptors(token: str, log: Any, api: str) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of an internal API's server; without a token it is open, and the
    log says so."""
    if not token:
        log.warning("%s is OPEN: no --service-token, any caller that reaches it is served", api)
        return []
    return [ServiceTokenInterceptor(token)]
