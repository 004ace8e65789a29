"""recipe process: ``python -m services.recipe --port N --entrypoint-address host:port``.

Serves OpenAI Chat Completions / Responses and Anthropic Messages, ``/healthz`` and
``/metrics`` on ``--port`` (``--http-port`` is not
used: the ops routes share the API port). Ready (``/healthz`` 200) while the entrypoint answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn

from libs.common.config import common_flags, flag
from libs.common.lifecycle import install_stop_handlers, new_instance_id, setup_logging

from .auth import KeyTable, parse_keys
from .backend import GrpcGenerateBackend
from .encoding import PromptEncoder
from .handlers import AppConfig, Metrics, build_app

SERVICE = "recipe"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.recipe", description=__doc__)
    flag(p, "--port", type=int, default=8000, help="HTTP port of the API (and /healthz, /metrics)")
    flag(p, "--entrypoint-address", default="127.0.0.1:50051", help="entrypoint gRPC host:port")
    flag(p, "--model-name", default="deepseek-tiny", help="the served model name (/v1/models)")
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


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service's stop event decides (lifecycle.py)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(args: argparse.Namespace, cfg: AppConfig) -> int:
    log = setup_logging(args.log_level, SERVICE)
    instance = new_instance_id(SERVICE, args.instance_id)
    stop = asyncio.Event()
    install_stop_handlers(stop)
    encoder = await asyncio.to_thread(PromptEncoder, [cfg.model_name], bool(args.default_thinking))
    backend = GrpcGenerateBackend(args.entrypoint_address)
    app = build_app(cfg, encoder, backend, Metrics())
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            lifespan="off",
            log_level=args.log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=max(1, int(args.drain_seconds)),
        )
    )
    task = asyncio.create_task(server.serve())
    log.info(
        "%s serving the OpenAI and Anthropic APIs on %s:%d for model %s via entrypoint %s",
        instance,
        args.host,
        args.port,
        cfg.model_name,
        args.entrypoint_address,
    )
    if cfg.keys.open:
        log.warning(
            "no API keys configured (--api-keys / --api-keys-file): the API is OPEN to "
            "anyone who can reach port %d",
            args.port,
        )
    else:
        log.info(
            "API keys required: %d keys for %d tenants",
            len(cfg.keys.keys),
            len(set(cfg.keys.keys.values())),
        )
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("stopping: finishing open requests for up to %.0fs", args.drain_seconds)
        server.should_exit = True
    else:
        stopping.cancel()
    await task
    await backend.close()
    if not server.started:
        log.error("could not start the HTTP server on %s:%d", args.host, args.port)
        return 1
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        keys = parse_keys(args.api_keys)
        if args.api_keys_file:
            try:
                with open(args.api_keys_file, encoding="utf-8") as f:
                    keys.update(parse_keys(f.read()))
            except OSError as exc:
                raise ValueError(f"--api-keys-file: {exc}") from None
        cfg = AppConfig(
            model_name=args.model_name,
            default_max_tokens=args.default_max_tokens,
            max_context=args.max_context,
            max_body_bytes=args.max_body_bytes,
            keys=KeyTable(keys),
        )
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must lie in [0, 65535], got {args.port}")
    except ValueError as exc:
        raise SystemExit(f"recipe: {exc}") from None
    return asyncio.run(serve(args, cfg))
