"""The flags every engine-wrapping service takes beside its model's (each with its
``DEEPSERVE_*`` twin): how often it heartbeats and logs its engine's stats, and -- for a
service that hands KV over (prefill, aggregated) -- where the kvstore is and how long a push
may take. One definition, so prefill, decode and aggregated cannot drift apart."""

from __future__ import annotations

import argparse

from libs.common.config import flag

PUSH_TIMEOUT_S = 30.0  # one KV push prefill -> decode (the gRPC deadline ends both sides)


def add_instance_flags(parser: argparse.ArgumentParser) -> None:
    flag(parser, "--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats")
    flag(
        parser,
        "--stats-interval",
        type=float,
        default=10.0,
        help="seconds between engine stats log lines (0: none)",
    )


def check_instance_flags(heartbeat_interval: float, stats_interval: float) -> None:
    """ValueError naming the flag that is wrong."""
    if heartbeat_interval <= 0:
        raise ValueError(f"--heartbeat-interval must be positive, got {heartbeat_interval}")
    if not stats_interval >= 0:
        raise ValueError(f"--stats-interval must be >= 0, got {stats_interval}")


def add_handoff_flags(parser: argparse.ArgumentParser, push_help: str) -> None:
    flag(parser, "--kvstore-address", default="", help="kvstore gRPC host:port (empty: no kvstore)")
    flag(parser, "--push-timeout", type=float, default=PUSH_TIMEOUT_S, help=push_help)


def check_handoff_flags(kvstore_address: str, push_timeout_s: float) -> None:
    """ValueError naming the flag that is wrong."""
    if kvstore_address and ":" not in kvstore_address:
        raise ValueError(f"--kvstore-address must be host:port, got {kvstore_address!r}")
    if push_timeout_s <= 0:
        raise ValueError(f"--push-timeout must be positive, got {push_timeout_s}")
