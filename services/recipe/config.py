"""The recipe's flags (each with its ``DEEPSERVE_*`` twin) and frozen config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from libs.common.auth import KeyTable, load_keys
from libs.common.config import ServiceConfig, check_port, common_flags, flag, service_config_from
from libs.common.grpc_auth import add_service_token_flag
from libs.common.tenant_label import add_tenant_label_flag, labels_from
from libs.transport.keycaps import (
    SharedState,
    add_key_limit_flags,
    key_limit_policy,
    shared_state_from,
)

from .handlers import MAX_BODY_BYTES, AppConfig
from .pool import DEFAULT_QUEUE_BYTES

SERVICE = "recipe"
DESCRIPTION = """\
recipe process: ``python -m services.recipe --port N --entrypoint-address host:port``.

Serves OpenAI Chat Completions / Responses and Anthropic Messages and ``/healthz`` on ``--port``
(public), ``/healthz``, ``/metrics`` and the ``/status`` page on the ops port ``--http-port``
(keep it private: the metrics carry hashed tenant labels, no key is asked). Ready
(``/healthz`` 200) while the entrypoint answers.
"""


@dataclass(frozen=True)
class StatusSources:
    """The ops ports (``host:port``, where their ``/metrics`` is) that ``/status`` reads, each
    list possibly empty (its panel then says "not configured"), and its tick in seconds."""

    kvstores: tuple[str, ...] = ()
    balancers: tuple[str, ...] = ()
    entrypoints: tuple[str, ...] = ()
    interval: float = 2.0

    def __post_init__(self) -> None:
        if not 0.1 <= self.interval <= 60:
            raise ValueError(
                f"--status-interval must lie in [0.1, 60] seconds, got {self.interval}"
            )


def parse_addresses(flag_name: str, value: str) -> tuple[str, ...]:
    """``host:port,host:port`` → the addresses; ValueError naming the flag for a bad one."""
    out = []
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{flag_name} takes host:port entries, comma-separated; got {item!r}")
        out.append(item)
    return tuple(out)


@dataclass(frozen=True)
class RecipeConfig:
    service: ServiceConfig  # its --http-port serves /healthz and /metrics (the ops port)
    app: AppConfig
    port: int = 8000
    entrypoint_address: str = "127.0.0.1:50051"
    default_thinking: bool = False
    # What the engines serve (their --model): it decides the tokenizer and the chat encoding.
    model: str = "tiny"
    # Connections: idle between requests, and the request head (connecting and sending nothing
    # or half a head holds a socket and a file descriptor for ever otherwise).
    keep_alive_timeout: float = 5.0
    header_timeout: float = 10.0
    # The entrypoint: its first event, and each next one (beyond its own 60 s request timeout).
    first_event_timeout: float = 120.0
    event_timeout: float = 120.0
    # Usage records: the JetStream stream ("" writes none) and how many may wait to be published.
    usage_stream: str = "DEEPSERVE_USAGE"
    usage_queue: int = 10000
    # The credential it presents to the entrypoint (the internal APIs' service token).
    service_token: str = field(default="", repr=False)
    # Redis of the per-key limits every replica shares (--redis-url; "": this process's own).
    shared: SharedState = field(default_factory=lambda: SharedState())
    # /status on the ops port (status.py): what it scrapes (ops ports, host:port) and how often.
    status: StatusSources = StatusSources()

    def __post_init__(self) -> None:
        check_port("--port", self.port)
        if self.usage_stream and not self.usage_stream.replace("_", "").replace("-", "").isalnum():
            raise ValueError(
                f"--usage-stream must be letters, digits, '-' and '_', got {self.usage_stream!r}"
            )
        if self.usage_queue <= 0:
            raise ValueError(f"--usage-queue must be positive, got {self.usage_queue}")
        if not self.model:
            raise ValueError("--model must name a preset, fake, or a checkpoint directory")
        for name, value in (
            ("--keep-alive-timeout", self.keep_alive_timeout),
            ("--header-timeout", self.header_timeout),
            ("--first-event-timeout", self.first_event_timeout),
            ("--event-timeout", self.event_timeout),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.recipe", description=DESCRIPTION)
    flag(p, "--port", type=int, default=8000, help="HTTP port of the API (and /healthz)")
    flag(p, "--entrypoint-address", default="127.0.0.1:50051", help="entrypoint gRPC host:port")
    flag(p, "--model-name", default="deepseek-tiny", help="the served model name (/v1/models)")
    flag(
        p,
        "--model",
        default="tiny",
        help="the model the engines serve (their --model: preset tiny, v2-lite, v3-slice, fake, "
        "or a checkpoint dir); it decides the tokenizer and chat encoding, and a tokenizer "
        "the model's vocabulary cannot hold is refused at start",
    )
    flag(
        p,
        "--default-max-tokens",
        type=int,
        default=4096,
        help="max_tokens when a request names none",
    )
    flag(p, "--max-context", type=int, default=163840, help="prompt + completion token limit")
    flag(
        p,
        "--default-thinking",
        type=bool,
        default=False,
        help="thinking mode for requests that do not say (deepseek-recipe's default is on)",
    )
    flag(
        p,
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="largest accepted request body (8 MiB: parsing one holds the GIL ~4-6 ms a MB)",
    )
    flag(
        p,
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds for a request body to arrive in full, else 408 and the connection closes",
    )
    flag(
        p,
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds for a request head to arrive (after connecting or the previous response), "
        "else the connection closes",
    )
    flag(
        p,
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    flag(
        p,
        "--encode-threads",
        type=int,
        default=0,
        help="threads that parse, render and tokenize requests (off the event loop); "
        "0: one per core this process may use",
    )
    flag(
        p,
        "--encode-queue-bytes",
        type=int,
        default=DEFAULT_QUEUE_BYTES,
        help="bytes of request bodies admitted to the encode threads (running or waiting) "
        "before a 429",
    )
    flag(
        p,
        "--first-event-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the entrypoint's first event of a request, else 504",
    )
    flag(
        p,
        "--event-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for each next event from the entrypoint, else 504",
    )
    flag(p, "--api-keys", default="", help="API keys: KEY=TENANT entries, comma-separated")
    flag(p, "--api-keys-file", default="", help="file of KEY=TENANT lines (# comments)")
    add_key_limit_flags(p)
    flag(
        p,
        "--usage-stream",
        default="DEEPSERVE_USAGE",
        help="JetStream stream of the usage records (one per request; created when missing; "
        "'' writes none)",
    )
    flag(
        p,
        "--usage-queue",
        type=int,
        default=10000,
        help="usage records waiting to be published before new ones are dropped (counted)",
    )
    for name, what in (
        ("kvstore", "capacity, stored bytes, target health, degraded reads"),
        ("balancer", "which length bucket each prefill instance serves"),
        ("entrypoint", "retries"),
    ):
        flag(
            p,
            f"--{name}-ops-address",
            default="",
            help=f"/status: ops ports (host:port, comma-separated) of the {name} processes, "
            f"whose /metrics give {what} ('': not shown)",
        )
    flag(
        p,
        "--status-interval",
        type=float,
        default=2.0,
        help="/status: seconds between two reads of the counters and the ops ports",
    )
    common_flags(p, SERVICE)
    add_service_token_flag(p)
    add_tenant_label_flag(p)
    return p


def config_from(args: argparse.Namespace) -> RecipeConfig:
    """The config of parsed flags; ValueError names the flag that is wrong.

    The one file read while building config: ``--api-keys-file``, so that a missing or bad key
    file is a config error (exit 2) found before any port opens.
    """
    keys = load_keys(args.api_keys, args.api_keys_file)
    return RecipeConfig(
        service_token=args.service_token,
        service=service_config_from(args, SERVICE),
        app=AppConfig(
            model_name=args.model_name,
            default_max_tokens=args.default_max_tokens,
            max_context=args.max_context,
            max_body_bytes=args.max_body_bytes,
            body_timeout=args.body_timeout,
            encode_threads=args.encode_threads,
            encode_queue_bytes=args.encode_queue_bytes,
            keys=KeyTable(keys),
            key_limits=key_limit_policy(args, keys),
            labels=labels_from(args),
        ),
        port=args.port,
        entrypoint_address=args.entrypoint_address,
        default_thinking=bool(args.default_thinking),
        model=args.model,
        keep_alive_timeout=args.keep_alive_timeout,
        header_timeout=args.header_timeout,
        first_event_timeout=args.first_event_timeout,
        event_timeout=args.event_timeout,
        usage_stream=args.usage_stream,
        usage_queue=args.usage_queue,
        shared=shared_state_from(args),
        status=StatusSources(
            kvstores=parse_addresses("--kvstore-ops-address", args.kvstore_ops_address),
            balancers=parse_addresses("--balancer-ops-address", args.balancer_ops_address),
            entrypoints=parse_addresses("--entrypoint-ops-address", args.entrypoint_ops_address),
            interval=args.status_interval,
        ),
    )
