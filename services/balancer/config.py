"""The balancer's flags (each with its ``DEEPSERVE_*`` twin) and frozen config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from libs.common.config import ServiceConfig, common_flags, flag, service_config_from
from libs.routing.buckets import DEFAULT_BOUNDS, check_bounds, parse_bounds

SERVICE = "balancer"
DESCRIPTION = """\
``python -m services.balancer``: routes requests to prefill/decode instances it hears about.

Subscribes ``ds.heartbeat.>`` (InstanceStatus) and answers ``ds.balancer.route`` in queue
group ``balancer`` (so several replicas share the requests). Each replica keeps its own table
from the heartbeats every instance broadcasts; they need no state in common.
"""


@dataclass(frozen=True)
class BalancerConfig:
    service: ServiceConfig
    heartbeat_timeout: float = 3.0
    warmup_seconds: float = 1.0
    prefill_buckets: tuple[int, ...] = DEFAULT_BOUNDS
    rebalance_interval: float = 10.0
    load_cap: float = 1.15
    load_weight: float = 2.0

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout > 0:
            raise ValueError(
                f"--heartbeat-timeout must be > 0 seconds, got {self.heartbeat_timeout}"
            )
        if self.warmup_seconds < 0:
            raise ValueError(f"--warmup-seconds must be >= 0, got {self.warmup_seconds}")
        if not self.rebalance_interval > 0:
            raise ValueError(
                f"--rebalance-interval must be > 0 seconds, got {self.rebalance_interval}"
            )
        check_bounds(self.prefill_buckets)
        if not self.load_cap >= 1.0:
            raise ValueError(f"--load-cap must be >= 1 (inf: off), got {self.load_cap}")
        if not self.load_weight >= 0.0:
            raise ValueError(f"--load-weight must be >= 0 (0: off), got {self.load_weight}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.balancer", description=DESCRIPTION)
    common_flags(parser, SERVICE)
    flag(
        parser,
        "--heartbeat-timeout",
        type=float,
        default=3.0,
        help="seconds without a heartbeat after which an instance is dead",
    )
    flag(
        parser,
        "--warmup-seconds",
        type=float,
        default=1.0,
        help="listen to heartbeats this long before answering routes (one heartbeat interval)",
    )
    flag(
        parser,
        "--prefill-buckets",
        default=",".join(map(str, DEFAULT_BOUNDS)),
        help="prompt-token bounds between prefill length buckets (comma-separated, increasing)",
    )
    flag(
        parser,
        "--rebalance-interval",
        type=float,
        default=10.0,
        help="seconds between re-assignments of prefill instances to buckets by demand",
    )
    flag(
        parser,
        "--load-cap",
        type=float,
        default=1.15,
        help="a prefill instance whose recent work passes this many times the mean takes no "
        "new request while another is under it, whatever it caches (inf: off)",
    )
    flag(
        parser,
        "--load-weight",
        type=float,
        default=2.0,
        help="price of recent work above the mean, in prompt tokens per unit of "
        "(work / mean - 1), against the tokens a cache hit saves (0: off)",
    )
    return parser


def config_from(args: argparse.Namespace) -> BalancerConfig:
    """The config of parsed flags; ValueError names the flag that is wrong."""
    return BalancerConfig(
        service=service_config_from(args, SERVICE),
        heartbeat_timeout=args.heartbeat_timeout,
        warmup_seconds=args.warmup_seconds,
        prefill_buckets=parse_bounds(args.prefill_buckets),
        rebalance_interval=args.rebalance_interval,
        load_cap=args.load_cap,
        load_weight=args.load_weight,
    )
