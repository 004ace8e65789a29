"""The entrypoint's Prometheus metrics (``deepserve_entrypoint_*``; the request metrics of the
served model are in ``request_metrics.py``, admission's in ``admission.py``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("deepserve_entrypoint_requests_total", "Generate calls by outcome", ["outcome"])
INFLIGHT = Gauge("deepserve_entrypoint_inflight_requests", "Generate calls in progress")
REQUEST_SECONDS = Histogram(
    "deepserve_entrypoint_request_seconds",
    "Generate call duration",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
TTFT_SECONDS = Histogram(
    "deepserve_entrypoint_time_to_first_token_seconds",
    "From the call to the first token sent",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TOKENS = Counter("deepserve_entrypoint_tokens_total", "Tokens by kind", ["kind"])
RETRIES = Counter(
    "deepserve_entrypoint_retries_total",
    "failed attempts by what followed (fresh, continue, gave_up)",
    ["action"],
)
REJECTED = Counter(
    "deepserve_entrypoint_rejected_total",
    "requests refused with RESOURCE_EXHAUSTED (no capacity within --admit-wait, or queue full)",
)
RETRY_AFTER = Histogram(
    "deepserve_entrypoint_retry_after_seconds",
    "retry hints sent with RESOURCE_EXHAUSTED (from the measured drain rates)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
TASK_COPIES = Counter(
    "deepserve_entrypoint_prefill_task_copies_total",
    "PrefillTasks sent again: not confirmed (a NATS outage, the instance not subscribed yet)",
)
LOOKUP_ERRORS = Counter(
    "deepserve_entrypoint_kvstore_lookup_errors_total",
    "kvstore lookups that failed (treated as a miss)",
)
LOCAL_ROUTES = Counter(
    "deepserve_entrypoint_local_routes_total",
    "requests routed on the entrypoint's own view of the instances: no balancer answered",
)
BALANCER_AWAY = Gauge(
    "deepserve_entrypoint_balancer_away",
    "1 while no balancer answers and requests are routed on the entrypoint's own view",
)
