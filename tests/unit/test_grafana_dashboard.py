"""docker/grafana/deepserve.json against the metrics the code defines: every metric a PromQL
expression names is exported by some service (a renamed metric breaks this test), quantiles
are taken over histogram buckets by ``le``, and every panel reads the ``${DS_PROMETHEUS}``
data source variable."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from libs.routing.policy import RoutingPolicy
from libs.serving.engine_metrics import EngineMetrics
from services.balancer import handlers as balancer_handlers
from services.balancer.metrics import BalancerMetrics
from services.entrypoint import request_metrics
from services.kvstore.handlers import Metrics as KVStoreRPCMetrics
from services.kvstore.metrics import StoreCollector, StoreMetrics, TargetHealth
from services.recipe.handlers import Metrics as RecipeMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "deepserve.json"
METRIC = re.compile(r"\bdeepserve[_:][A-Za-z0-9_:]*")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def _names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` can expose, with or without samples yet."""
    out: set[str] = set()
    for family in registry.collect():
        if not family.name.startswith("deepserve"):
            continue
        out.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        out.update(s.name for s in family.samples)
    return out


@pytest.fixture(scope="module")
def defined() -> set[str]:
    registry = CollectorRegistry()
    EngineMetrics("m", "both", registry)  # neither prefill nor decode: every engine series
    RecipeMetrics(registry)
    KVStoreRPCMetrics(registry)
    StoreMetrics(registry)
    registry.register(StoreCollector(lambda: (0, 0), TargetHealth([]), 0))
    BalancerMetrics(registry, RoutingPolicy())
    assert balancer_handlers.ROUTES  # the balancer's older series live in the default registry
    assert request_metrics.SUCCESS  # so do the entrypoint's request-level series
    return _names(registry) | _names(REGISTRY)


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _exprs(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            exprs.append(q["query"])
    return exprs


def test_every_metric_the_dashboard_queries_is_defined(defined: set[str]) -> None:
    exprs = _exprs(_dashboard())
    assert len(exprs) > 30
    missing = {m: e for e in exprs for m in METRIC.findall(e) if m not in defined}
    assert not missing, f"metrics no service defines: {missing}"


def test_the_dashboard_covers_engines_requests_kvstore_balancer_and_recipe() -> None:
    used = {m for e in _exprs(_dashboard()) for m in METRIC.findall(e)}
    for name in (
        "deepserve:time_to_first_token_seconds_bucket",
        "deepserve:inter_token_latency_seconds_bucket",
        "deepserve:num_requests_running",
        "deepserve:num_requests_waiting",
        "deepserve:kv_cache_usage_perc",
        "deepserve:prefix_cache_hits_total",
        "deepserve:prefix_cache_queries_total",
        "deepserve:engine_step_duration_seconds_bucket",
        "deepserve:engine_busy_fraction",
        "deepserve:request_queue_time_seconds_bucket",
        "deepserve:request_prefill_time_seconds_bucket",
        "deepserve:request_decode_time_seconds_bucket",
        "deepserve:request_time_per_output_token_seconds_bucket",
        "deepserve:request_success_total",
        "deepserve:generation_tokens_total",
        "deepserve:prompt_tokens_total",
        "deepserve:kvstore_stored_bytes",
        "deepserve:kvstore_stored_blocks",
        "deepserve:kvstore_evictions_total",
        "deepserve:kvstore_degraded_reads_total",
        "deepserve:kvstore_repaired_shards_total",
        "deepserve:kvstore_target_up",
        "deepserve:balancer_routing_decisions_total",
        "deepserve:balancer_bucket_queued_tokens",
        "deepserve:balancer_live_instances",
        "deepserve_recipe_requests_total",
        "deepserve_recipe_request_seconds_bucket",
    ):
        assert name in used, f"no panel shows {name}"


def test_quantiles_are_over_buckets_by_le_and_panels_use_the_datasource_variable() -> None:
    dash = _dashboard()
    for e in _exprs(dash):
        if "histogram_quantile" in e:
            assert re.search(r"sum by \(le\b", e) and "_bucket" in e, e
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = []
    for p in _panels(dash):
        ids.append(p["id"])
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    assert len(ids) == len(set(ids)), "panel ids must be unique"
