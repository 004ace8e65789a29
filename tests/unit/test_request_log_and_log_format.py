"""Operator-facing logs: the entrypoint's one line per request (tenant hashed, never named),
the opt-in JSON log format of every service, and the OTLP warning."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid

import pytest

from libs.common.config import ServiceConfig, common_flags, service_config_from
from libs.common.logs import JsonFormatter
from libs.common.tenant_label import UNSALTED
from libs.proto.deepserve.v1 import control_pb2
from tests.unit.test_entrypoint_handlers import FakeBus, FakeContext, greedy_events, make, req
from tests.unit.test_entrypoint_retry import FULL, FlakyBus

ACME_HASH = UNSALTED("acme")  # no --tenant-label-secret in these handlers


def request_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "entrypoint"
        and r.getMessage().startswith("request ")
        and "fields" in r.__dict__
    ]


async def test_one_line_per_request_with_hashed_tenant(caplog: pytest.LogCaptureFixture) -> None:
    bus = FakeBus()  # 3 tokens: 7, 8, 9
    h = make(bus)
    with caplog.at_level(logging.INFO, logger="entrypoint"):
        events = [
            ev
            async for ev in h.Generate(
                req(list(range(1, 11)), tenant="acme", request_id="r-log"), FakeContext()
            )
        ]
    assert events[-1].WhichOneof("event") == "finish"
    (rec,) = request_lines(caplog)
    f = rec.fields  # type: ignore[attr-defined]
    assert f["request_id"] == "r-log" and f["outcome"] == "ok"
    assert f["tenant_hash"] == ACME_HASH
    assert (f["prompt_tokens"], f["cached_tokens"], f["completion_tokens"]) == (10, 0, 3)
    assert f["attempts"] == 1
    assert f["ttft_s"] is not None and 0 <= f["ttft_s"] <= f["duration_s"]
    assert len(f["trace_id"]) == 32 and int(f["trace_id"], 16) != 0
    text = rec.getMessage()
    assert "acme" not in text and "acme" not in json.dumps(f)
    assert f"tenant={ACME_HASH}" in text and "request r-log ok:" in text
    assert f"trace={f['trace_id']}" in text
    # The same line as JSON: the fields are top-level keys.
    obj = json.loads(JsonFormatter("entrypoint").format(rec))
    assert obj["tenant_hash"] == ACME_HASH and obj["completion_tokens"] == 3
    assert obj["msg"] == text and obj["level"] == "INFO" and obj["service"] == "entrypoint"


async def test_request_line_counts_attempts_after_a_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = FlakyBus(["error@2", "ok"])
    with caplog.at_level(logging.INFO, logger="entrypoint"):
        [ev async for ev in make(bus).Generate(req([1, 2, 3], max_tokens=5), FakeContext())]
    (rec,) = request_lines(caplog)
    f = rec.fields  # type: ignore[attr-defined]
    assert f["attempts"] == 2 and f["outcome"] == "ok"
    assert f["completion_tokens"] == len(FULL) and f["tenant_hash"] == "-"


async def test_a_refused_request_is_logged_with_its_outcome(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = make(FakeBus(), api_keys={"sk-a": "acme"})
    with caplog.at_level(logging.INFO, logger="entrypoint"), pytest.raises(Exception):
        [ev async for ev in h.Generate(req([1, 2, 3], tenant="acme"), FakeContext())]
    (rec,) = request_lines(caplog)
    f = rec.fields  # type: ignore[attr-defined]
    assert f["outcome"] == "invalid" and f["request_id"] == "-" and f["attempts"] == 0
    assert f["tenant_hash"] == "-"  # no credential: no tenant was verified


def test_json_formatter_output_parses() -> None:
    rec = logging.LogRecord("decode", logging.WARNING, __file__, 1, "a %s b", ("x",), None)
    obj = json.loads(JsonFormatter("decode", rank=2).format(rec))
    assert obj["msg"] == "a x b" and obj["level"] == "WARNING" and obj["rank"] == 2
    assert obj["logger"] == "decode" and obj["ts"].endswith("+00:00")
    try:
        raise ValueError("boom")
    except ValueError:
        rec.exc_info = sys.exc_info()
    assert "ValueError: boom" in json.loads(JsonFormatter("decode").format(rec))["exc"]


def test_log_format_flag_env_twin_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    monkeypatch.setenv("DEEPSERVE_LOG_FORMAT", "json")
    p = argparse.ArgumentParser()
    common_flags(p, "balancer")
    assert service_config_from(p.parse_args([]), "balancer").log_format == "json"
    assert service_config_from(p.parse_args(["--log-format", "text"]), "x").log_format == "text"
    with pytest.raises(ValueError, match="--log-format"):
        ServiceConfig(log_format="yaml")


def test_a_service_process_logs_json_lines_redacted() -> None:
    """A fresh process (no test harness handlers): what setup_logging installs is what a
    service writes; every line parses, secrets in URLs stay hidden, EP ranks are named."""
    code = (
        "import logging\n"
        "from libs.common.logs import setup_logging, tag_rank\n"
        "log = setup_logging('INFO', 'decode', 'json')\n"
        "log.info('dialing %s', 'nats://user:hunter2@nats:4222')\n"
        "logging.getLogger('libs.x').warning('second')\n"
        "tag_rank('decode', 1)\n"
        "log.info('third')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert [o["msg"].split()[0] for o in lines] == ["dialing", "second", "third"]
    assert "hunter2" not in out.stderr
    assert lines[0]["service"] == "decode" and lines[1]["logger"] == "libs.x"
    assert "rank" not in lines[0] and lines[2]["rank"] == 1


def test_otlp_endpoint_without_exporter_package_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The package missing (the test extra installs it): its import fails as it would.
    for kind in ("grpc", "http"):
        monkeypatch.setitem(
            sys.modules, f"opentelemetry.exporter.otlp.proto.{kind}.trace_exporter", None
        )
    from libs.common.telemetry import tracer

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    name = f"svc-{uuid.uuid4().hex[:6]}"
    with caplog.at_level(logging.WARNING, logger="libs.common.telemetry"):
        tracer(name)
    (rec,) = [r for r in caplog.records if "OTLP" in r.getMessage()]
    assert rec.levelno == logging.WARNING and name in rec.getMessage()
    assert "opentelemetry-exporter-otlp" in rec.getMessage()


async def test_request_line_carries_decodes_speculative_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The finishing event's draft counts (decode speculated) reach the request's line."""

    def speculative(task: control_pb2.PrefillTask) -> list[control_pb2.TokenEvent]:
        evs = greedy_events(task, [7, 8, 9])
        evs[-1].speculative.CopyFrom(control_pb2.SpecCounts(drafted=9, verified=6, accepted=4))
        return evs

    with caplog.at_level(logging.INFO, logger="entrypoint"):
        [ev async for ev in make(FakeBus(speculative)).Generate(req([1, 2]), FakeContext())]
        [ev async for ev in make(FakeBus()).Generate(req([1, 2]), FakeContext())]
    spec, plain = request_lines(caplog)
    f = spec.fields  # type: ignore[attr-defined]
    assert (f["spec_drafted"], f["spec_verified"], f["spec_accepted"]) == (9, 6, 4)
    assert spec.getMessage().endswith(" drafted=9 verified=6 accepted=4")
    assert "spec_verified" not in plain.fields and "drafted=" not in plain.getMessage()  # type: ignore[attr-defined]
