"""Health, Prometheus metrics and OpenTelemetry context for every service.

:class:`OpsServer` serves ``GET /readyz`` (200 when the service says it is ready to take
work, 503 with the reason otherwise; ``/healthz`` is the same), ``GET /livez`` (200 while the
process's event loop answers: a Kubernetes liveness probe) and ``GET /metrics`` (Prometheus
text) on one small HTTP port.
Trace context travels as a W3C ``traceparent`` string inside proto messages and gRPC
metadata, so one request's spans join up across every hop. Spans are exported where asked:
``DEEPSERVE_TRACE_FILE=path`` appends them as JSON lines (``{service}`` in the path is
replaced by the service name), and ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) sends them over OTLP when the
``opentelemetry-exporter-otlp`` package is installed (the ``otlp`` extra): gRPC by default,
HTTP with ``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`` (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
wins over it). The exporters read the rest of OpenTelemetry's variables themselves (headers,
timeouts, certificates). Spans carry ``service.name`` = ``OTEL_SERVICE_NAME`` when it is set
(``{service}`` in it replaced by the service name), else the service name, and
``deepserve.service`` = the service name either way.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

HealthFn = Callable[[], tuple[bool, str]]
# An extra GET route of an ops port: () -> (content type, body, extra header lines "K: v\r\n").
OpsRoute = Callable[[], tuple[str, bytes, str]]

log = logging.getLogger(__name__)


class OpsServer:
    """``routes``: extra GET paths a service serves beside the probes and metrics (the
    recipe's ``/status``), answered 200 with what the function returns."""

    def __init__(
        self,
        host: str,
        port: int,
        health: HealthFn,
        routes: Mapping[str, OpsRoute] | None = None,
    ) -> None:
        self.host, self.port, self.health = host, port, health
        self.routes = dict(routes or {})
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = line.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else "/"
            route = path.split("?", 1)[0]
            extra = ""
            if route in self.routes:
                ctype, body, extra = self.routes[route]()
                status = 200
            elif path.startswith("/metrics"):
                status, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest(REGISTRY)
            elif route == "/livez":
                # Answered by this event loop, so a 200 proves the loop is not wedged; it
                # never consults the service (a NATS or Redis outage is not a reason to
                # restart the process -- that is what readiness is for).
                status, ctype, body = 200, "application/json", b'{"status": "ok"}'
            elif route == "/readyz" or path.startswith("/healthz"):
                ok, why = self.health()
                status, ctype = (200 if ok else 503), "application/json"
                body = json.dumps({"status": "ok" if ok else "unavailable", "detail": why}).encode()
            else:
                status, ctype, body = 404, "text/plain", b"not found\n"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):  # ValueError: a line over 64 KiB
            pass
        finally:
            writer.close()


_PROVIDERS: dict[str, TracerProvider] = {}


class JsonLinesExporter(SpanExporter):
    """One JSON object per finished span, appended to a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as f:
            for span in spans:
                f.write(span.to_json(indent=None) + "\n")
        return SpanExportResult.SUCCESS


def resource(service: str) -> Resource:
    """The spans' resource: OpenTelemetry's own variables (``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_SERVICE_NAME``) respected, the service named where they do not name it."""
    name = os.environ.get("OTEL_SERVICE_NAME", "").strip().replace("{service}", service)
    return Resource.create({"service.name": name or service, "deepserve.service": service})


OTLP_PROTOCOLS = ("grpc", "http/protobuf")


def otlp_exporter(service: str) -> SpanExporter | None:
    """The OTLP exporter the environment asks for, or None (none asked, package missing or a
    protocol it cannot speak: said once in the log, since spans then go nowhere)."""
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return None
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if protocol not in OTLP_PROTOCOLS:
        log.warning(
            "OTLP protocol %r is not one of %s: %s spans are NOT exported over OTLP",
            protocol,
            ", ".join(OTLP_PROTOCOLS),
            service,
        )
        return None
    kind = "grpc" if protocol == "grpc" else "http"
    try:
        module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{kind}.trace_exporter")
    except ImportError:
        # Optional package; a configured endpoint that gets nothing must be said.
        log.warning(
            "an OTLP endpoint is set but the opentelemetry-exporter-otlp package is not "
            "installed: %s spans are NOT exported over OTLP (pip install 'deepserve[otlp]')",
            service,
        )
        return None
    exporter: SpanExporter = module.OTLPSpanExporter()  # reads the OTEL_EXPORTER_OTLP_* rest
    return exporter


def tracer(service: str) -> trace.Tracer:
    """A tracer for this service; spans export only where an exporter is configured."""
    provider = _PROVIDERS.get(service)
    if provider is None:
        provider = TracerProvider(resource=resource(service))
        path = os.environ.get("DEEPSERVE_TRACE_FILE")
        if path:
            provider.add_span_processor(
                SimpleSpanProcessor(JsonLinesExporter(path.replace("{service}", service)))
            )
        exporter = otlp_exporter(service)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        _PROVIDERS[service] = provider
    return provider.get_tracer(service)


def inject_traceparent() -> str:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def extract_context(traceparent: str) -> Context:
    return propagate.extract({"traceparent": traceparent} if traceparent else {})
