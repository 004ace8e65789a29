"""The API's access log: one line per HTTP request at the front door, when its response ends.

``http POST /v1/chat/completions 429 0.004s tenant=3f2a9c1b trace=4bf92f3577b34da6a3ce929d0e0e4736
request=9a1f...`` -- the status the client got (``499``: it went away before a response
started), the time from the request's arrival to the response's last byte (a stream's whole
length), the tenant as its label -- the deployment's salted hash, as in the metrics and the
entrypoint's request line (``libs/common/tenant_label.py``; ``-``: no valid key, or no keys
configured) --, the trace id and, where the response names one, the request id. With
``--log-format json`` the same values are fields of the line's JSON object (``method``,
``path``, ``status``, ``latency_s``, ``tenant_hash``, ``trace_id``, ``request_id``). Query
strings, keys and tenant names are never logged.

The trace id is the request's: the middleware opens the recipe's server span (a child of the
caller's ``traceparent`` when one came) and hands it to the handlers as the request's
``traceparent``, so the handler's span, the entrypoint's request line and this line share it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opentelemetry import trace

from libs.common.auth import KeyTable
from libs.common.logs import FIELDS_ATTR
from libs.common.telemetry import extract_context, inject_traceparent, tracer
from libs.common.tenant_label import UNSALTED, TenantLabels

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("recipe.access")


class AccessLog:
    """ASGI middleware around the API app: one ``recipe.access`` INFO line per HTTP request."""

    def __init__(self, app: ASGIApp, keys: KeyTable, labels: TenantLabels = UNSALTED) -> None:
        self.app, self.keys, self.labels = app, keys, labels
        self.tracer = tracer("recipe")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method, path = scope.get("method", "-"), scope.get("path", "-")
        span = self.tracer.start_span(
            f"recipe.http {method}",
            context=extract_context(headers.get("traceparent", "")),
            kind=trace.SpanKind.SERVER,
        )
        span.set_attribute("http.request.method", method)
        span.set_attribute("url.path", path)
        with trace.use_span(span, end_on_exit=False):
            traceparent = inject_traceparent()
        inner = dict(scope)
        inner["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"traceparent"]
        inner["headers"].append((b"traceparent", traceparent.encode("latin-1")))
        seen: dict[str, Any] = {"status": 0, "request_id": ""}

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                for k, v in message.get("headers", ()):
                    if k.lower() == b"x-request-id":
                        seen["request_id"] = v.decode("latin-1")
            await send(message)

        try:
            await self.app(inner, receive, send_logged)
        finally:
            status = seen["status"] or 499  # no response started: the client went away
            span.set_attribute("http.response.status_code", status)
            span.end()
            self._line(method, path, status, time.perf_counter() - t0, headers, span, seen)

    def _line(
        self,
        method: str,
        path: str,
        status: int,
        latency_s: float,
        headers: dict[str, str],
        span: trace.Span,
        seen: dict[str, Any],
    ) -> None:
        tenant = self.labels(self.keys.tenant(headers))
        trace_id = format(span.get_span_context().trace_id, "032x")
        fields = {
            "method": method,
            "path": path,
            "status": status,
            "latency_s": round(latency_s, 6),
            "tenant_hash": tenant,
            "trace_id": trace_id,
            "request_id": seen["request_id"],
        }
        rid = f" request={seen['request_id']}" if seen["request_id"] else ""
        log.info(
            "http %s %s %d %.3fs tenant=%s trace=%s%s",
            method,
            path,
            status,
            latency_s,
            tenant,
            trace_id,
            rid,
            extra={FIELDS_ATTR: fields},
        )


def access_log(app: ASGIApp, keys: KeyTable, labels: TenantLabels = UNSALTED) -> AccessLog:
    """``app`` with an access log line per request (services/recipe/main.py wraps the API)."""
    return AccessLog(app, keys, labels)
