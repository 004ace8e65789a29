"""The aggregated service's flags (each with its ``DEEPSERVE_*`` twin) and frozen config.

The union of what prefill and decode take, with one difference in defaults: a step carries
prompt chunks beside running decodes, so its time budget is what a decode step may wait for
a chunk (``--step-time-budget`` 0.1 s and ``--max-tokens-per-step`` 8192, against 1 s and
32768 for a prefill engine).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from libs.common.config import ServiceConfig, check_port, common_flags, flag, service_config_from
from libs.common.grpc_auth import add_service_token_flag
from libs.serving.model_flags import ModelFlags, add_model_flags, model_flags_from
from services.prefill.clients import PUSH_TIMEOUT_S

SERVICE = "aggregated"
DESCRIPTION = (
    "aggregated instance (prefill and decode on one engine): ``python -m services.aggregated "
    "--grpc-port 50061 --nats-url nats://... [--kvstore-address host:port]``."
)
# A mixed step's budget: one step this long holds every running decode's next token, so it
# bounds the time between tokens that a prompt chunk adds (~6K v2-lite prompt tokens on an
# H100 at its measured ~63K tokens/s). 8K tokens a step also shrinks the activation reserve
# (sized from the step's tokens) a quarter of a prefill engine's, leaving the room to KV.
STEP_TIME_BUDGET_S = 0.1
MAX_TOKENS_PER_STEP = 8192


@dataclass(frozen=True)
class AggregatedConfig:
    service: ServiceConfig
    model: ModelFlags
    grpc_port: int = 0
    kvstore_address: str = ""  # empty: no kvstore (no cached prefixes, no block writes)
    service_token: str = field(default="", repr=False)  # the internal APIs' credential
    push_timeout_s: float = PUSH_TIMEOUT_S  # hand-overs to other decode instances
    heartbeat_interval: float = 1.0
    stats_interval: float = 10.0  # seconds between engine stats log lines (0: none)

    def __post_init__(self) -> None:
        check_port("--grpc-port", self.grpc_port)
        if self.kvstore_address and ":" not in self.kvstore_address:
            raise ValueError(f"--kvstore-address must be host:port, got {self.kvstore_address!r}")
        if self.push_timeout_s <= 0:
            raise ValueError(f"--push-timeout must be positive, got {self.push_timeout_s}")
        if self.heartbeat_interval <= 0:
            raise ValueError(
                f"--heartbeat-interval must be positive, got {self.heartbeat_interval}"
            )
        if not self.stats_interval >= 0:
            raise ValueError(f"--stats-interval must be >= 0, got {self.stats_interval}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.aggregated", description=DESCRIPTION)
    common_flags(parser, SERVICE)
    add_service_token_flag(parser)
    add_model_flags(
        parser, max_tokens_per_step=MAX_TOKENS_PER_STEP, step_time_budget=STEP_TIME_BUDGET_S
    )
    flag(parser, "--grpc-port", type=int, default=0, help="KVTransfer gRPC port (0: any free)")
    flag(parser, "--kvstore-address", default="", help="kvstore gRPC host:port (empty: no kvstore)")
    flag(
        parser,
        "--push-timeout",
        type=float,
        default=PUSH_TIMEOUT_S,
        help="seconds for one KV push to another decode instance",
    )
    flag(parser, "--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats")
    flag(
        parser,
        "--stats-interval",
        type=float,
        default=10.0,
        help="seconds between engine stats log lines (0: none)",
    )
    return parser


def config_from(args: argparse.Namespace) -> AggregatedConfig:
    """The config of parsed flags; ValueError names the flag that is wrong."""
    return AggregatedConfig(
        service_token=args.service_token,
        service=service_config_from(args, SERVICE),
        model=model_flags_from(args),
        grpc_port=args.grpc_port,
        kvstore_address=args.kvstore_address,
        push_timeout_s=args.push_timeout,
        heartbeat_interval=args.heartbeat_interval,
        stats_interval=args.stats_interval,
    )
