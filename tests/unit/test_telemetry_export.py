"""Where spans go (issue 38 item 7): OTEL_SERVICE_NAME names them, and OTLP reaches a
collector over HTTP (http/protobuf) as well as gRPC -- checked against a local receiver of
each kind, decoding what arrived."""

from __future__ import annotations

import http.server
import itertools
import logging
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from libs.common import telemetry

from ..hf_reference import require_reference

# The otlp extra (in the test extra too); missing under CI is a failure, not a skip.
require_reference("opentelemetry.exporter.otlp.proto.http.trace_exporter")
require_reference("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
from opentelemetry.proto.collector.trace.v1 import (  # noqa: E402  (after the skip)
    trace_service_pb2,
    trace_service_pb2_grpc,
)

_names = itertools.count()


def fresh_service() -> str:
    """Providers are cached per service name: each test takes one nobody used."""
    return f"svc-export-{next(_names)}-{threading.get_ident()}"


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[tuple[str, dict]]:
    out = []
    for rs in request.resource_spans:
        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            out += [(s.name, attrs) for s in ss.spans]
    return out


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "DEEPSERVE_TRACE_FILE",
    ):
        monkeypatch.delenv(name, raising=False)


def test_otel_service_name_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    assert telemetry.resource("decode").attributes["service.name"] == "decode"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-prod")
    attrs = telemetry.resource("decode").attributes
    assert attrs["service.name"] == "llm-prod" and attrs["deepserve.service"] == "decode"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "deepserve-{service}")
    assert telemetry.resource("recipe").attributes["service.name"] == "deepserve-recipe"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    attrs = telemetry.resource("recipe").attributes
    assert attrs["deployment.environment"] == "staging" and attrs["service.name"] == "recipe"


class _Collector(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["content-length"]))
        type(self).received.append((self.path, body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_collector() -> Iterator[str]:
    _Collector.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_otlp_over_http(monkeypatch: pytest.MonkeyPatch, http_collector: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", http_collector)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-prod")
    service = fresh_service()
    with telemetry.tracer(service).start_as_current_span("recipe.chat"):
        pass
    assert telemetry._PROVIDERS[service].force_flush(10_000)
    paths = [path for path, _ in _Collector.received]
    assert paths == ["/v1/traces"]
    request = trace_service_pb2.ExportTraceServiceRequest.FromString(_Collector.received[0][1])
    ((name, attrs),) = spans_of(request)
    assert name == "recipe.chat"
    assert attrs["service.name"] == "llm-prod" and attrs["deepserve.service"] == service


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(  # noqa: N802 (the proto's name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_over_grpc_stays_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    service_impl = _TraceService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service_impl, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        service = fresh_service()
        with telemetry.tracer(service).start_as_current_span("entrypoint.generate"):
            pass
        assert telemetry._PROVIDERS[service].force_flush(10_000)
    finally:
        server.stop(None)
    ((name, attrs),) = [s for r in service_impl.received for s in spans_of(r)]
    assert name == "entrypoint.generate" and attrs["service.name"] == service


def test_traces_protocol_wins_and_an_unknown_one_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    exporter = telemetry.otlp_exporter("recipe")
    assert exporter is not None and "proto.http" in type(exporter).__module__
    exporter.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with caplog.at_level(logging.WARNING):
        assert telemetry.otlp_exporter("recipe") is None
    assert "http/json" in caplog.text and "NOT exported" in caplog.text
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    assert telemetry.otlp_exporter("recipe") is None  # no endpoint: no exporter, no noise
