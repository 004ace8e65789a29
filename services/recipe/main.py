"""recipe process: ``python -m services.recipe --port N --entrypoint-address host:port``.

Serves OpenAI Chat Completions / Responses and Anthropic Messages, ``/healthz`` and
``/metrics`` on ``--port`` (``--http-port`` is not
used: the ops routes share the API port). Ready (``/healthz`` 200) while the entrypoint answers.

``--model`` (what the engines serve) decides the tokenizer and chat encoding; a tokenizer that
can emit ids beyond the model's vocabulary is refused before any port opens: one line in the
log, exit code 2 (as a bad flag), rather than a 502 on every request.

Wiring only: flags in ``config.py``, the API in ``handlers.py``. uvicorn runs as a task inside
the shared lifecycle (``libs/common/service.py``): the stop event, not uvicorn, hears SIGTERM,
and the exit stack stops uvicorn (open requests finish within ``--drain-seconds``), then closes
the entrypoint channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from libs.common.service import ServiceContext, run_service

from .backend import GrpcGenerateBackend
from .config import SERVICE, RecipeConfig, build_parser, config_from
from .encoding import load_encoder
from .handlers import Metrics, build_app


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build_parser, config_from, serve)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service's stop event decides."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _run_uvicorn(server: _Server) -> None:
    try:
        await server.serve()
    except SystemExit:  # uvicorn's way to report a port it cannot bind; server.started says so
        pass


async def _stop_uvicorn(
    server: _Server, task: asyncio.Task[None], drain_seconds: float, log: logging.Logger
) -> None:
    if not task.done():
        log.info("stopping: finishing open requests for up to %.0fs", drain_seconds)
    server.should_exit = True
    await task


async def serve(cfg: RecipeConfig, ctx: ServiceContext) -> int:
    svc, log = cfg.service, ctx.log
    try:
        served, encoder = await asyncio.to_thread(
            load_encoder, cfg.model, [cfg.app.model_name], cfg.default_thinking
        )
    except ValueError as exc:  # the model and its tokenizer disagree: a config error
        log.error("cannot serve: %s", exc)
        return 2
    log.info("model %s: tokenizer %s", cfg.model, served.describe)
    backend = GrpcGenerateBackend(cfg.entrypoint_address)
    ctx.stack.push_async_callback(backend.close)
    app = build_app(cfg.app, encoder, backend, Metrics())
    server = _Server(
        uvicorn.Config(
            app,
            host=svc.host,
            port=cfg.port,
            lifespan="off",
            log_level=svc.log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=max(1, int(svc.drain_seconds)),
        )
    )
    task = asyncio.create_task(_run_uvicorn(server), name="uvicorn")
    ctx.stack.push_async_callback(_stop_uvicorn, server, task, svc.drain_seconds, log)
    log.info(
        "%s serving the OpenAI and Anthropic APIs on %s:%d for model %s via entrypoint %s",
        svc.instance_id,
        svc.host,
        cfg.port,
        cfg.app.model_name,
        cfg.entrypoint_address,
    )
    keys = cfg.app.keys
    if keys.open:
        log.warning(
            "no API keys configured (--api-keys / --api-keys-file): the API is OPEN to "
            "anyone who can reach port %d",
            cfg.port,
        )
    else:
        log.info(
            "API keys required: %d keys for %d tenants",
            len(keys.keys),
            len(set(keys.keys.values())),
        )
    stopping = asyncio.create_task(ctx.stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done() and not server.started:
        log.error("could not start the HTTP server on %s:%d", svc.host, cfg.port)
        return 1
    return 0
