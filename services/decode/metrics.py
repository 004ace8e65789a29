"""Decode's own Prometheus series (``deepserve_decode_*``, the default registry); the
engine's are ``libs/serving/engine_metrics.py``'s."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter("deepserve_decode_requests_total", "KV pushes by outcome", ["outcome"])
TOKENS = Counter("deepserve_decode_tokens_total", "tokens generated and published")
ERRORS = Counter("deepserve_decode_errors_total", "requests that ended in an error event")
KV_BYTES = Counter("deepserve_decode_kv_bytes_total", "KV frame bytes received")
KV_BLOCKS = Counter(
    "deepserve_decode_kv_blocks_total",
    "prompt blocks of accepted requests by where they came from",
    # resident (already here), peer (copied from prefill's pool), bytes (a frame), local (an
    # aggregated instance's own prompt: never moved)
    ["source"],
)
STORED_BLOCKS = Counter(
    "deepserve_decode_kvstore_blocks_put_total", "generated blocks written to the kvstore"
)
STORE_ERRORS = Counter("deepserve_decode_kvstore_errors_total", "failed kvstore writes")
STORE_DROPPED = Counter(
    "deepserve_decode_kvstore_writes_dropped_total",
    "kvstore writes not started: the write-behind bound was reached",
)
RESENDS = Counter(
    "deepserve_decode_resends_total",
    "KVTransfer.Resend calls answered with events (the entrypoint lost some: a NATS outage)",
)
LATENCY = Histogram(
    "deepserve_decode_request_seconds",
    "KV accepted -> last token published",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
PEER_REFUSED = Counter(
    "deepserve_decode_peer_refs_refused_total",
    "KV pool references refused before the pool was opened: unsigned, forged, another "
    "request's, stale or replayed (libs/serving/peer_seal.py)",
)
