"""The decode service as deployed (its own process, ``--model fake``, no NATS reachable): its
ops port's ``/metrics`` carries the engine metrics under the served model's name, its log is
JSON lines with ``DEEPSERVE_LOG_FORMAT=json``, and it logs a stats line every
``--stats-interval``. Only loopback sockets; NATS is a closed local port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, deadline: float) -> str:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = str(r.read().decode())
            if "deepserve:num_requests_running" in text:
                return text
        except OSError:
            pass
        assert time.monotonic() < deadline, "the engine metrics never appeared on /metrics"
        time.sleep(0.2)


def test_decode_service_exports_engine_metrics_and_logs_json_stats() -> None:
    ops = free_port()
    env = dict(os.environ, DEEPSERVE_LOG_FORMAT="json")
    argv = [
        *(sys.executable, "-m", "services.decode", "--model", "fake", "--model-name", "fk"),
        *("--nats-url", f"nats://127.0.0.1:{free_port()}", "--http-port", str(ops)),
        *("--stats-interval", "0.3", "--num-kv-blocks", "64"),
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        text = scrape(ops, time.monotonic() + 60)
        time.sleep(1.0)  # a few stats lines
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    for line in (
        'deepserve:num_requests_running{model_name="fk"} 0.0',
        'deepserve:num_requests_waiting{model_name="fk"} 0.0',
        'deepserve:kv_cache_usage_perc{model_name="fk"} 0.0',
        'deepserve:prefix_cache_queries_total{model_name="fk"} 0.0',
        'deepserve:num_preemptions_total{model_name="fk"} 0.0',
        'deepserve:e2e_request_latency_seconds_count{model_name="fk"} 0.0',
        'deepserve:inter_token_latency_seconds_count{model_name="fk"} 0.0',
        'deepserve:engine_step_duration_seconds_count{model_name="fk"} 0.0',
    ):
        assert line in text, line
    assert "# TYPE deepserve:kv_cache_usage_perc gauge" in text
    assert "# TYPE deepserve:e2e_request_latency_seconds histogram" in text
    assert "time_to_first_token" not in text  # a prefill series
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert records and all(r["service"] == "decode" for r in records)
    stats = [r for r in records if r["msg"].startswith("engine stats: ")]
    assert len(stats) >= 2, [r["msg"] for r in records]
    assert "running=0 waiting=0 kv_usage=0.0%" in stats[0]["msg"]
    assert "prompt_tokens/s" not in stats[0]["msg"]  # decode computes no prompts
