"""Balancer policy: prefill length buckets and instance routing, with no I/O (CPU-tested)."""
