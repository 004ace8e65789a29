"""Prefill's own Prometheus series (``deepserve_prefill_*``, the default registry); the
engine's are ``libs/serving/engine_metrics.py``'s."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter("deepserve_prefill_requests_total", "prefill tasks by outcome", ["outcome"])
ERRORS = Counter("deepserve_prefill_errors_total", "prefill failures by stage", ["stage"])
LATENCY = Histogram(
    "deepserve_prefill_seconds",
    "task received -> KV handed to decode",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CACHED_BLOCKS = Counter(
    "deepserve_prefill_kvstore_blocks_loaded_total", "prefix blocks loaded from the kvstore"
)
STORED_BLOCKS = Counter("deepserve_prefill_kvstore_blocks_put_total", "blocks sent to the kvstore")
FORGED = Counter(
    "deepserve_prefill_kv_integrity_failures_total",
    "kvstore blocks whose MAC did not match (forged or altered): treated as a miss",
)
OWN_BLOCKS = Counter(
    "deepserve_prefill_resident_blocks_total",
    "cached prefix blocks found in this engine's own cache (not fetched)",
)
HANDOFF_BLOCKS = Counter(
    "deepserve_prefill_handoff_blocks_total",
    "prompt blocks at hand-over by how they reached decode",
    ["how"],  # held (decode had them), peer (pool reference), bytes (a frame)
)
STORE_DROPPED = Counter(
    "deepserve_prefill_kvstore_writes_dropped_total",
    "kvstore writes not started: the write-behind bound was reached",
)
RESENDS = Counter("deepserve_prefill_handoff_resends_total", "hand-overs sent again", ["why"])
DUPLICATES = Counter(
    "deepserve_prefill_duplicate_tasks_total",
    "copies of a PrefillTask already in flight or seen lately (sent again after a NATS outage)",
)
