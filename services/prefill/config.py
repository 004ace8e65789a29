"""The prefill service's flags (each with its ``DEEPSERVE_*`` twin) and frozen config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from libs.common.config import ServiceConfig, common_flags, service_config_from
from libs.common.grpc_auth import add_service_token_flag
from libs.serving.ep import EPFlags, add_ep_flags, check_ep_model, ep_flags_from
from libs.serving.instance_flags import (
    PUSH_TIMEOUT_S,
    add_handoff_flags,
    add_instance_flags,
    check_handoff_flags,
    check_instance_flags,
)
from libs.serving.model_flags import ModelFlags, add_model_flags, model_flags_from

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
        check_handoff_flags(self.kvstore_address, self.push_timeout_s)
        check_instance_flags(self.heartbeat_interval, self.stats_interval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.prefill", description=DESCRIPTION)
    common_flags(parser, SERVICE)
    add_service_token_flag(parser)
    add_model_flags(parser)
    add_ep_flags(parser, SERVICE)
    add_handoff_flags(parser, "seconds for one KV push to decode")
    add_instance_flags(parser)
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
