"""The aggregated service's flags (each with its ``DEEPSERVE_*`` twin) and frozen config.

The union of what prefill and decode take, with other step defaults: a step carries prompt
chunks beside running decodes, so ``--max-tokens-per-step`` 8192 (against 32768 for a prefill
engine) bounds what a chunk adds to the time between their tokens (~0.15 s of v2-lite on an
H100), and no time budget (``--step-time-budget 0``): the cost model prices a step by a
factor over a FLOP/byte estimate, and measured on the H100 a mixed step's fixed host work
(~40 ms eager, against ~3 ms estimated) read as slow tokens held chunks to ~200 tokens under a
0.1 s budget -- prompt work at a quarter of the engine's rate and chat TTFT p50 of 4.3 s.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from libs.common.config import ServiceConfig, check_port, common_flags, flag, service_config_from
from libs.common.grpc_auth import add_service_token_flag
from libs.serving.instance_flags import (
    PUSH_TIMEOUT_S,
    add_handoff_flags,
    add_instance_flags,
    check_handoff_flags,
    check_instance_flags,
)
from libs.serving.model_flags import ModelFlags, add_model_flags, model_flags_from

SERVICE = "aggregated"
DESCRIPTION = (
    "aggregated instance (prefill and decode on one engine): ``python -m services.aggregated "
    "--grpc-port 50061 --nats-url nats://... [--kvstore-address host:port]``."
)
# 8K prompt tokens a step: ~0.13 s of v2-lite on an H100 (63K tokens/s measured) added to the
# running decodes' next token; it also sizes the activation reserve a quarter of a prefill
# engine's, leaving that room to KV. No time budget (module doc).
STEP_TIME_BUDGET_S = 0.0
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
        check_handoff_flags(self.kvstore_address, self.push_timeout_s)
        check_instance_flags(self.heartbeat_interval, self.stats_interval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.aggregated", description=DESCRIPTION)
    common_flags(parser, SERVICE)
    add_service_token_flag(parser)
    add_model_flags(
        parser, max_tokens_per_step=MAX_TOKENS_PER_STEP, step_time_budget=STEP_TIME_BUDGET_S
    )
    flag(parser, "--grpc-port", type=int, default=0, help="KVTransfer gRPC port (0: any free)")
    add_handoff_flags(parser, "seconds for one KV push to another decode instance")
    add_instance_flags(parser)
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
