"""Flags with environment twins: ``--nats-url`` is also ``DEEPSERVE_NATS_URL``.

Services build an ``argparse`` parser with :func:`flag`; the environment supplies defaults,
the command line wins. Values are validated when the service's frozen config is built.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

ENV_PREFIX = "DEEPSERVE_"


def env_name(flag_name: str) -> str:
    return ENV_PREFIX + flag_name.lstrip("-").replace("-", "_").upper()


def flag(
    parser: argparse.ArgumentParser,
    name: str,
    *,
    type: Any = str,
    default: Any = None,
    help: str = "",
    env: str | None = None,
) -> None:
    """Add ``--name`` whose default comes from its environment twin (or ``env``) if set."""
    env = env or env_name(name)
    raw = os.environ.get(env)
    value = default
    if raw is not None:
        try:
            value = type(raw) if type is not bool else raw.lower() in ("1", "true", "yes", "on")
        except ValueError:
            raise SystemExit(
                f"environment variable {env}={raw!r} is not a valid {type.__name__}"
            ) from None
    kwargs: dict[str, Any] = {"default": value, "help": f"{help} [env {env}]".strip()}
    if type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = type
    parser.add_argument(name, **kwargs)


def common_flags(parser: argparse.ArgumentParser, service: str) -> None:
    """Flags every service has."""
    flag(parser, "--nats-url", default="nats://127.0.0.1:4222", help="NATS server", env="NATS_URL")
    flag(
        parser,
        "--http-port",
        type=int,
        default=0,
        help="port of /healthz and /metrics (0: any free)",
    )
    flag(parser, "--host", default="127.0.0.1", help="address to bind")
    flag(
        parser,
        "--instance-id",
        default="",
        help=f"unique {service} instance name (default: generated)",
    )
    flag(
        parser,
        "--drain-seconds",
        type=float,
        default=10.0,
        help="SIGTERM: finish work for this long",
    )
    flag(parser, "--log-level", default="INFO", help="logging level")
