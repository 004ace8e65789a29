"""Balancer policy: prefill length buckets and instance routing, with no I/O (unit-tested on a CPU)."""
