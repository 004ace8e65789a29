"""The recipe's flags (each with its ``DEEPSERVE_*`` twin) and frozen config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from libs.common.config import ServiceConfig, check_port, common_flags, flag, service_config_from

from .auth import KeyTable, parse_keys
from .handlers import AppConfig

SERVICE = "recipe"
DESCRIPTION = """\
recipe process: ``python -m services.recipe --port N --entrypoint-address host:port``.

Serves OpenAI Chat Completions / Responses and Anthropic Messages, ``/healthz`` and
``/metrics`` on ``--port`` (``--http-port`` is not
used: the ops routes share the API port). Ready (``/healthz`` 200) while the entrypoint answers.
"""


@dataclass(frozen=True)
class RecipeConfig:
    service: ServiceConfig  # its --http-port is unused: /healthz and /metrics are on --port
    app: AppConfig
    port: int = 8000
    entrypoint_address: str = "127.0.0.1:50051"
    default_thinking: bool = False
    # What the engines serve (their --model): it decides the tokenizer and the chat encoding.
    model: str = "tiny"

    def __post_init__(self) -> None:
        check_port("--port", self.port)
        if not self.model:
            raise ValueError("--model must name a preset, fake, or a checkpoint directory")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.recipe", description=DESCRIPTION)
    flag(p, "--port", type=int, default=8000, help="HTTP port of the API (and /healthz, /metrics)")
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
    flag(p, "--max-body-bytes", type=int, default=32 << 20, help="largest accepted request body")
    flag(p, "--api-keys", default="", help="API keys: KEY=TENANT entries, comma-separated")
    flag(p, "--api-keys-file", default="", help="file of KEY=TENANT lines (# comments)")
    common_flags(p, SERVICE)
    return p


def config_from(args: argparse.Namespace) -> RecipeConfig:
    """The config of parsed flags; ValueError names the flag that is wrong.

    The one file read while building config: ``--api-keys-file``, so that a missing or bad key
    file is a config error (exit 2) found before any port opens.
    """
    keys = parse_keys(args.api_keys)
    if args.api_keys_file:
        try:
            with open(args.api_keys_file, encoding="utf-8") as f:
                keys.update(parse_keys(f.read()))
        except OSError as exc:
            raise ValueError(f"--api-keys-file: {exc}") from None
    return RecipeConfig(
        service=service_config_from(args, SERVICE),
        app=AppConfig(
            model_name=args.model_name,
            default_max_tokens=args.default_max_tokens,
            max_context=args.max_context,
            max_body_bytes=args.max_body_bytes,
            keys=KeyTable(keys),
        ),
        port=args.port,
        entrypoint_address=args.entrypoint_address,
        default_thinking=bool(args.default_thinking),
        model=args.model,
    )
