"""The kvstore's flags (each with its ``DEEPSERVE_*`` twin) and frozen config.

``deepserve kvstore fsck`` takes the same flags (:func:`build_parser` on its subparser) so it
opens the same targets and Redis as the service.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from libs.common.config import ServiceConfig, check_port, common_flags, flag, service_config_from
from libs.common.grpc_auth import add_service_token_flag
from libs.common.redact import redacted_repr
from libs.kvstore.policy import DAY_S, Retention

SERVICE = "kvstore"
DESCRIPTION = """\
kvstore process:
``python -m services.kvstore --grpc-port N --redis-url redis://... --data-dir DIR``.

Serves ``deepserve.v1.KVStore`` and gRPC health on ``--grpc-port``; ``/healthz`` and ``/metrics``
on ``--http-port``. Ready (``/healthz`` 200, gRPC health SERVING) only while Redis answers.

Storage targets: ``--target DIR_OR_S3`` (repeated) or ``--targets a,b,...``; at least 12
(10 data + 2 parity shards per block, each on a distinct target). Without any, 12 directories
``<data-dir>/targets/t00..t11`` are used. ``s3://bucket`` targets go through boto3 to
``--s3-endpoint`` (credentials from the usual AWS variables). The process keeps no state of
its own: several may serve the same targets and Redis.
"""


@dataclass(frozen=True)
class KVStoreConfig:
    service: ServiceConfig
    grpc_port: int
    redis_url: str
    data_dir: Path
    max_message_bytes: int = 64 << 20
    targets: tuple[str, ...] = ()
    s3_endpoint: str = ""
    capacity_bytes: int = 0
    chat_ttl: float = 7 * DAY_S
    agent_ttl: float = 3 * DAY_S
    sweep_interval: float = 60.0
    ec_backend: str = ""
    orphan_interval: float = 3600.0
    orphan_grace: float = 600.0
    service_token: str = field(default="", repr=False)  # the internal APIs' credential

    __repr__ = redacted_repr  # the Redis URL may carry a password

    def __post_init__(self) -> None:
        if self.targets and len(set(self.targets)) < 12:
            raise ValueError(
                f"10+2 erasure coding needs at least 12 distinct targets, got "
                f"{len(set(self.targets))}: {', '.join(self.targets)}"
            )
        if self.sweep_interval <= 0:
            raise ValueError(f"--sweep-interval must be > 0 seconds, got {self.sweep_interval}")
        if self.orphan_interval < 0:
            raise ValueError(
                f"--orphan-interval must be >= 0 seconds (0: off), got {self.orphan_interval}"
            )
        if self.orphan_grace < 0:
            raise ValueError(f"--orphan-grace must be >= 0 seconds, got {self.orphan_grace}")
        self.retention()  # validates TTLs and capacity
        check_port("--grpc-port", self.grpc_port)
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"--redis-url must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}"
            )
        if self.max_message_bytes < (1 << 20):
            raise ValueError(
                f"--max-message-bytes must be at least 1 MiB, got {self.max_message_bytes}"
            )

    def retention(self) -> Retention:
        return Retention({"chat": self.chat_ttl, "agent": self.agent_ttl}, self.capacity_bytes)

    def target_specs(self) -> list[str]:
        return list(self.targets) or [
            str(self.data_dir / "targets" / f"t{i:02d}") for i in range(12)
        ]


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="python -m services.kvstore", description=DESCRIPTION)
    flag(
        p, "--grpc-port", type=int, default=0, help="gRPC port of KVStore and health (0: any free)"
    )
    flag(
        p,
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="Redis holding block metadata",
        env="REDIS_URL",
    )
    flag(p, "--data-dir", default=".run/kvstore", help="base of the default 12 target directories")
    p.add_argument(
        "--target",
        action="append",
        default=[],
        help="a storage target: a directory (one per SSD/server) or s3://bucket; repeat",
    )
    flag(p, "--targets", default="", help="comma-separated storage targets (adds to --target)")
    flag(p, "--s3-endpoint", default="", help="S3 endpoint URL of s3:// targets (empty: AWS)")
    flag(
        p,
        "--capacity-bytes",
        type=int,
        default=0,
        help="evict least recently used chain tails past this many block bytes (0: no limit)",
    )
    flag(
        p,
        "--chat-ttl",
        type=float,
        default=7 * DAY_S,
        help="seconds a chat block lives after last use",
    )
    flag(
        p,
        "--agent-ttl",
        type=float,
        default=3 * DAY_S,
        help="seconds an agent block lives after last use",
    )
    flag(p, "--sweep-interval", type=float, default=60.0, help="seconds between retention sweeps")
    # Redis losing its data (or a crash between shards and metadata) leaves shards no metadata
    # names; they are collected once older than the grace, which must exceed the longest put.
    flag(
        p,
        "--orphan-interval",
        type=float,
        default=3600.0,
        help="seconds between collections of orphan shards (0: off; fsck --repair does it too)",
    )
    flag(
        p,
        "--orphan-grace",
        type=float,
        default=600.0,
        help="only shards older than this many seconds can be collected as orphans",
    )
    flag(
        p,
        "--ec-backend",
        default="",
        help="pyeclib backend (default: isa_l_rs_vand, then fallbacks)",
    )
    # A DeepSeek-V3 block is 61 layers x 576 x 2 bytes x 128 tokens = 9 MB: past gRPC's 4 MiB
    # default.
    flag(
        p,
        "--max-message-bytes",
        type=int,
        default=64 << 20,
        help="largest gRPC message (one block)",
    )
    common_flags(p, SERVICE)
    add_service_token_flag(p)
    return p


def config_from(a: argparse.Namespace) -> KVStoreConfig:
    """The config of parsed kvstore flags; ValueError names the flag that is wrong."""
    return KVStoreConfig(
        service_token=a.service_token,
        service=service_config_from(a, SERVICE),
        grpc_port=a.grpc_port,
        redis_url=a.redis_url,
        data_dir=Path(a.data_dir),
        max_message_bytes=a.max_message_bytes,
        targets=tuple(a.target + [t for t in a.targets.split(",") if t]),
        s3_endpoint=a.s3_endpoint,
        capacity_bytes=a.capacity_bytes,
        chat_ttl=a.chat_ttl,
        agent_ttl=a.agent_ttl,
        sweep_interval=a.sweep_interval,
        ec_backend=a.ec_backend,
        orphan_interval=a.orphan_interval,
        orphan_grace=a.orphan_grace,
    )


def config_from_args(a: argparse.Namespace) -> KVStoreConfig:
    """:func:`config_from` for ``deepserve kvstore fsck``: a bad flag ends the command."""
    try:
        return config_from(a)
    except ValueError as exc:
        raise SystemExit(f"kvstore: {exc}") from None


def parse_config(argv: list[str] | None = None) -> KVStoreConfig:
    return config_from_args(build_parser().parse_args(argv))
