"""The prefill service's flags (each with its ``DEEPSERVE_*`` twin) and frozen config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from libs.common.config import ServiceConfig, common_flags, flag, service_config_from
from libs.common.grpc_auth import add_service_token_flag
from libs.serving.ep import EPFlags, add_ep_flags, check_ep_model, ep_flags_from
from libs.serving.model_flags import ModelFlags, add_model_flags, model_flags_from

from .clients import PUSH_TIMEOUT_S

SERVICE = "prefill"
DESCRIPTION = (
    "prefill service: ``python -m services.prefill --nats-url nats://... "
    "[--kvstore-address host:port]``."
)


@dataclass(frozen=True)
class PrefillConfig:
    service: ServiceConfig
    model: ModelFlags
    kvstore_address: str = ""  # empty: no kvstore (no cached prefixes, no block writes)
    service_token: str = field(default="", repr=False)  # the internal APIs' credential
    push_timeout_s: float = PUSH_TIMEOUT_S
    heartbeat_interval: float = 1.0
    stats_interval: float = 10.0  # seconds between engine stats log lines (0: none)
    ep: EPFlags = field(default_factory=EPFlags)  # --ep N: this instance is N rank processes

    def __post_init__(self) -> None:
        check_ep_model(self.ep, self.model)
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
    parser = argparse.ArgumentParser(prog="python -m services.prefill", description=DESCRIPTION)
    common_flags(parser, SERVICE)
    add_service_token_flag(parser)
    add_model_flags(parser)
    add_ep_flags(parser, SERVICE)
    flag(parser, "--kvstore-address", default="", help="kvstore gRPC host:port (empty: no kvstore)")
    flag(
        parser,
        "--push-timeout",
        type=float,
        default=PUSH_TIMEOUT_S,
        help="seconds for one KV push to decode",
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


def config_from(args: argparse.Namespace) -> PrefillConfig:
    """The config of parsed flags; ValueError names the flag that is wrong."""
    return PrefillConfig(
        service_token=args.service_token,
        service=service_config_from(args, SERVICE),
        model=model_flags_from(args),
        kvstore_address=args.kvstore_address,
        push_timeout_s=args.push_timeout,
        heartbeat_interval=args.heartbeat_interval,
        stats_interval=args.stats_interval,
        ep=ep_flags_from(args),
    )
