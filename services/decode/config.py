"""The decode service's flags (each with its ``DEEPSERVE_*`` twin) and frozen config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from libs.common.config import ServiceConfig, check_port, common_flags, flag, service_config_from
from libs.common.grpc_auth import add_service_token_flag
from libs.serving.ep import EPFlags, add_ep_flags, check_ep_model, ep_flags_from
from libs.serving.instance_flags import add_instance_flags, check_instance_flags
from libs.serving.model_flags import ModelFlags, add_model_flags, model_flags_from

SERVICE = "decode"
DESCRIPTION = (
    "decode service: ``python -m services.decode --grpc-port 50061 --nats-url nats://...``."
)


@dataclass(frozen=True)
class DecodeConfig:
    service: ServiceConfig
    model: ModelFlags
    grpc_port: int = 0
    heartbeat_interval: float = 1.0
    stats_interval: float = 10.0  # seconds between engine stats log lines (0: none)
    ep: EPFlags = field(default_factory=EPFlags)  # --ep N: this instance is N rank processes
    kvstore_address: str = ""  # host:port; empty: generated blocks are not written back
    service_token: str = field(default="", repr=False)  # the internal APIs' credential

    def __post_init__(self) -> None:
        check_ep_model(self.ep, self.model)
        check_port("--grpc-port", self.grpc_port)
        check_instance_flags(self.heartbeat_interval, self.stats_interval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.decode", description=DESCRIPTION)
    common_flags(parser, SERVICE)
    add_service_token_flag(parser)
    add_model_flags(parser)
    add_ep_flags(parser, SERVICE)
    flag(parser, "--grpc-port", type=int, default=0, help="KVTransfer gRPC port (0: any free)")
    add_instance_flags(parser)
    flag(
        parser,
        "--kvstore-address",
        default="",
        help="kvstore gRPC host:port: finished requests' new blocks are written there "
        "(empty: not written)",
    )
    return parser


def config_from(args: argparse.Namespace) -> DecodeConfig:
    """The config of parsed flags; ValueError names the flag that is wrong."""
    return DecodeConfig(
        service_token=args.service_token,
        service=service_config_from(args, SERVICE),
        model=model_flags_from(args),
        grpc_port=args.grpc_port,
        heartbeat_interval=args.heartbeat_interval,
        stats_interval=args.stats_interval,
        ep=ep_flags_from(args),
        kvstore_address=args.kvstore_address,
    )
