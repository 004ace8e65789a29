"""The entrypoint's flags (each with its ``DEEPSERVE_*`` twin) and frozen config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from libs.common.auth import load_keys
from libs.common.config import ServiceConfig, check_port, common_flags, flag, service_config_from
from libs.common.grpc_auth import add_service_token_flag
from libs.common.tenant_label import add_tenant_label_flag, labels_from
from libs.gateway.admission import parse_tenant_weights
from libs.gateway.policy import Limits
from libs.transport.keycaps import (
    SharedState,
    add_key_limit_flags,
    key_limit_policy,
    shared_state_from,
)

from .handler_config import HandlerConfig

SERVICE = "entrypoint"
DESCRIPTION = """\
``python -m services.entrypoint``: the public token-level gRPC API (``deepserve.v1.Generate``).
"""


@dataclass(frozen=True)
class EntrypointConfig:
    service: ServiceConfig
    handler: HandlerConfig
    grpc_port: int
    kvstore_address: str = ""
    kvstore_timeout: float = 1.0
    nats_wait: float = 10.0
    # Redis of the key limits shared with the recipe replicas and of the usage ledger
    shared: SharedState = SharedState()

    def __post_init__(self) -> None:
        check_port("--grpc-port", self.grpc_port)
        if self.kvstore_address and ":" not in self.kvstore_address:
            raise ValueError(f"--kvstore-address must be host:port, got {self.kvstore_address!r}")
        if not self.kvstore_timeout > 0:
            raise ValueError(f"--kvstore-timeout must be > 0 seconds, got {self.kvstore_timeout}")
        if not self.nats_wait > 0:
            raise ValueError(f"--nats-wait must be > 0 seconds, got {self.nats_wait}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.entrypoint", description=DESCRIPTION)
    common_flags(parser, SERVICE)
    add_service_token_flag(parser)
    add_tenant_label_flag(parser)
    flag(
        parser,
        "--api-keys",
        default="",
        help="API keys of Generate's callers: KEY=TENANT entries, comma-separated (the "
        "recipe's sources); with keys, a caller needs authorization: Bearer KEY (or the "
        "service token) and its tenant comes from the key",
    )
    flag(parser, "--api-keys-file", default="", help="file of KEY=TENANT lines (# comments)")
    add_key_limit_flags(parser)
    flag(parser, "--grpc-port", type=int, default=50051, help="port of the Generate gRPC API")
    flag(parser, "--kvstore-address", default="", help="kvstore gRPC host:port (empty: no cache)")
    flag(
        parser,
        "--kvstore-timeout",
        type=float,
        default=1.0,
        help="seconds to wait for a kvstore lookup before computing the prompt from scratch",
    )
    flag(parser, "--model-name", default="deepseek-tiny", help="served model name")
    flag(parser, "--vocab-size", type=int, default=129280, help="token ids must lie below this")
    flag(parser, "--max-context", type=int, default=163840, help="prompt + completion token limit")
    flag(parser, "--block-size", type=int, default=128, help="tokens per KV block (hash chain)")
    flag(
        parser, "--route-timeout", type=float, default=2.0, help="seconds to wait for the balancer"
    )
    flag(
        parser,
        "--nats-wait",
        type=float,
        default=10.0,
        help="seconds a request waits for NATS to come back (and for the balancer and the "
        "prefill instance to subscribe again) before UNAVAILABLE",
    )
    flag(
        parser,
        "--request-timeout",
        type=float,
        default=60.0,
        help="seconds without a token event after which a request is aborted",
    )
    flag(
        parser,
        "--capacity-admission",
        type=bool,
        default=True,
        help="admit a request only when a prefill instance can queue its uncached tokens and "
        "a decode instance has KV blocks for prompt + max_tokens (from heartbeats); "
        "--no-capacity-admission: --max-inflight alone",
    )
    flag(
        parser,
        "--prefill-queue-tokens",
        type=int,
        default=65536,
        help="prompt tokens a prefill instance may have queued, counting a new request's "
        "uncached ones, until its heartbeat carries a measured compute rate (then "
        "--prefill-queue-seconds applies; an idle instance takes any prompt; 0: no limit). "
        "65536 = two 32K prefill steps, about 1 s of v2-lite on an H200",
    )
    flag(
        parser,
        "--prefill-queue-seconds",
        type=float,
        default=2.0,
        help="seconds of work a prefill instance may have queued, counting a new request's "
        "uncached tokens, at the instance's own measured rate (tokens it will compute, its "
        "resident prefixes excluded; an idle instance takes any prompt; 0: the token limit "
        "alone)",
    )
    flag(
        parser,
        "--max-inflight",
        type=int,
        default=256,
        help="requests served at once, a cap on top of capacity (0: no cap); more wait, then "
        "get RESOURCE_EXHAUSTED",
    )
    flag(
        parser,
        "--max-waiting",
        type=int,
        default=256,
        help="requests that may wait for capacity, all tenants together; past that "
        "RESOURCE_EXHAUSTED at once, unless another tenant holds more of the queue (its newest "
        "waiter then gives way)",
    )
    flag(
        parser,
        "--tenant-weights",
        default="",
        help="weights of weighted fair queuing over tenants at admission: TENANT=WEIGHT entries, "
        "comma-separated (e.g. a=2,b=1: a gets twice b's uncached prompt tokens admitted while "
        "both wait, and twice b's share of a prefill step's prompt tokens while both have "
        "prompts there); unlisted tenants weigh 1",
    )
    flag(
        parser,
        "--cache-salt-secret",
        default="",
        help="secret keying the tenants' cache salts (the same on every entrypoint; pass it "
        "through the environment). Changing it renames every cached block (all become misses). "
        "Empty: a random one per process",
    )
    flag(
        parser,
        "--admit-wait",
        type=float,
        default=10.0,
        help="seconds a request waits for capacity before RESOURCE_EXHAUSTED (a burst of "
        "long prompts drains at the prefill rate: ~10 s is 600K tokens of v2-lite on an H200)",
    )
    flag(
        parser,
        "--retry-after-ms",
        type=int,
        default=500,
        help="retry hint sent with RESOURCE_EXHAUSTED (trailing metadata retry-after-ms) until "
        "a drain rate has been measured; then it is derived from the rate",
    )
    flag(
        parser,
        "--max-attempts",
        type=int,
        default=3,
        help="attempts per request when instances fail (1: no retry)",
    )
    flag(
        parser,
        "--instance-dead-after",
        type=float,
        default=3.0,
        help="seconds without a heartbeat after which a serving instance counts as dead",
    )
    return parser


def config_from(args: argparse.Namespace) -> EntrypointConfig:
    """The config of parsed flags; ValueError names the flag that is wrong."""
    api_keys = load_keys(args.api_keys, args.api_keys_file)
    limits = Limits(
        model_name=args.model_name,
        vocab_size=args.vocab_size,
        max_context=args.max_context,
        block_size=args.block_size,
    )
    return EntrypointConfig(
        service=service_config_from(args, SERVICE),
        handler=HandlerConfig(
            limits=limits,
            route_timeout=args.route_timeout,
            request_timeout=args.request_timeout,
            max_inflight=args.max_inflight,
            max_waiting=args.max_waiting,
            admit_wait=args.admit_wait,
            retry_after_ms=args.retry_after_ms,
            capacity_admission=args.capacity_admission,
            prefill_queue_tokens=args.prefill_queue_tokens,
            prefill_queue_seconds=args.prefill_queue_seconds,
            tenant_weights=parse_tenant_weights(args.tenant_weights),
            max_attempts=args.max_attempts,
            instance_dead_after=args.instance_dead_after,
            salt_secret=args.cache_salt_secret.encode(),
            api_keys=api_keys,
            service_token=args.service_token,
            key_limits=key_limit_policy(args, api_keys),
            labels=labels_from(args),
        ),
        shared=shared_state_from(args),
        grpc_port=args.grpc_port,
        kvstore_address=args.kvstore_address,
        kvstore_timeout=args.kvstore_timeout,
        nats_wait=args.nats_wait,
    )
