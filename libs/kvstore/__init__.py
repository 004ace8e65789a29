"""kvstore policy: shard placement and retention decisions, with no I/O (unit-tested on a CPU)."""
