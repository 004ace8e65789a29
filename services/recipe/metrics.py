"""The recipe's Prometheus metrics (the ops port serves them). A tenant label is the
deployment's salted hash of the tenant (``AppConfig.labels``), never its name."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram


class Metrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.requests = Counter(
            "deepserve_recipe_requests_total",
            "HTTP requests by route, status and tenant (a salted hash)",
            ["route", "status", "tenant"],
            registry=registry,
        )
        self.latency = Histogram(
            "deepserve_recipe_request_seconds",
            "generation time, to the last byte",
            ["stream"],
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.ttft = Histogram(
            "deepserve_recipe_time_to_first_token_seconds",
            "request to first token",
            registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.tokens = Counter(
            "deepserve_recipe_tokens_total",
            "tokens by kind (prompt, cached, completion) and tenant (a salted hash)",
            ["kind", "tenant"],
            registry=registry,
        )
        self.disconnects = Counter(
            "deepserve_recipe_client_disconnects_total",
            "requests whose client went away before the answer ended",
            registry=registry,
        )
        self.key_limited = Counter(
            "deepserve_recipe_key_limited_total",
            "requests refused with 429 by their API key's limit (reason: concurrency, tokens)",
            ["reason", "tenant"],
            registry=registry,
        )
        self.usage_records = Counter(
            "deepserve_recipe_usage_records_total",
            "usage records by outcome (published, dropped_queue_full, failed)",
            ["outcome"],
            registry=registry,
        )
