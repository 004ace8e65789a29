"""recipe process: ``python -m services.recipe --port N --entrypoint-address host:port``.

Serves OpenAI Chat Completions / Responses and Anthropic Messages and ``/healthz`` on ``--port``
(public); ``/healthz`` and ``/metrics`` on the ops port ``--http-port``, as every service does
(``ServiceContext.start_ops``), plus the ``/status`` page and ``/status.json``
(``status_http.py``; fed in the background by ``status_collect.py`` from heartbeats, its own
counters and the ``--*-ops-address`` ports): the public port serves no metrics. Ready
(``/healthz`` 200) while the entrypoint answers; the ops port's health is the entrypoint check
of at most ``HEALTH_POLL_S`` ago.

``--model`` (what the engines serve) decides the tokenizer and chat encoding; a tokenizer that
can emit ids beyond the model's vocabulary is refused before any port opens: one line in the
log, exit code 2 (as a bad flag), rather than a 502 on every request.

Wiring only: flags in ``config.py``, the API in ``handlers.py``, uvicorn and its connection
timeouts in ``server.py``. uvicorn runs as a task inside the shared lifecycle
(``libs/common/service.py``): the stop event, not uvicorn, hears SIGTERM, and the exit stack
stops uvicorn (open requests finish within ``--drain-seconds``), then flushes the usage
records (``usage.py``) and closes their NATS connection, the encode pool, the entrypoint
channel and the ops port. The usage publisher connects to NATS in the background: the API
serves while NATS is away (records queue, bounded).
"""

from __future__ import annotations

import asyncio

from libs.common.service import ServiceContext, run_service
from libs.common.tenant_label import warn_if_unsalted
from libs.transport.keycaps import KeyCaps, open_redis

from .access_log import access_log
from .app import build_app
from .backend import GenerateBackend, GrpcGenerateBackend
from .config import SERVICE, RecipeConfig, build_parser, config_from
from .encoding import load_encoder
from .handlers import Metrics
from .pool import EncodePool
from .server import build_server, run_server, stop_server
from .status import StatusBoard
from .status_collect import StatusCollector
from .status_http import status_routes
from .usage import UsagePublisher

HEALTH_POLL_S = 1.0


def main(argv: list[str] | None = None) -> int:
    return run_service(SERVICE, argv, build_parser, config_from, serve)


class _Health:
    """The entrypoint check, refreshed in the background for the ops port's sync health."""

    def __init__(self, backend: GenerateBackend) -> None:
        self.backend = backend
        self.state = (False, "starting: the entrypoint has not been checked yet")

    def __call__(self) -> tuple[bool, str]:
        return self.state

    async def poll(self) -> None:
        while True:
            try:
                self.state = await self.backend.check()
            except Exception as exc:  # a check that cannot even run is "not ready", not a crash
                self.state = (False, f"entrypoint check failed: {exc!r}")
            await asyncio.sleep(HEALTH_POLL_S)


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
    backend = GrpcGenerateBackend(
        cfg.entrypoint_address,
        first_event_timeout=cfg.first_event_timeout,
        event_timeout=cfg.event_timeout,
        service_token=cfg.service_token,
    )
    health = _Health(backend)
    board = StatusBoard(cfg.status.interval)
    ops_port = await ctx.start_ops(health, status_routes(board))
    ctx.stack.push_async_callback(backend.close)
    ctx.background(health.poll(), "health")
    pool = EncodePool(
        cfg.app.encode_threads, cfg.app.encode_queue_bytes, cfg.app.retry_after_s * 1000
    )
    ctx.stack.callback(pool.close)
    metrics = Metrics()  # the ops port's registry
    collector = StatusCollector(
        board,
        metrics,
        svc.nats_url,
        f"{svc.instance_id}-status",
        cfg.status.kvstores,
        cfg.status.balancers,
        cfg.status.entrypoints,
        ctx.stop,
        log,
    )
    ctx.background(collector.run(), "status")
    usage = None
    if cfg.usage_stream:
        usage = UsagePublisher(
            svc.nats_url,
            f"{svc.instance_id}-usage",
            cfg.usage_stream,
            cfg.usage_queue,
            metrics.usage_records,
            ctx.stop,
            log,
            labels=cfg.app.labels,
        )
        usage.start()
        ctx.stack.push_async_callback(usage.close, svc.drain_seconds)  # after uvicorn stopped
    else:
        log.warning("--usage-stream is empty: no usage records are written")
    app = build_app(cfg.app, encoder, backend, metrics, pool, usage, limiter=_limiter(cfg, ctx))
    server = build_server(
        access_log(app, cfg.app.keys, cfg.app.labels),
        svc.host,
        cfg.port,
        log_level=svc.log_level,
        drain_seconds=svc.drain_seconds,
        keep_alive_timeout=cfg.keep_alive_timeout,
        header_timeout=cfg.header_timeout,
    )
    task = asyncio.create_task(run_server(server), name="uvicorn")
    ctx.stack.push_async_callback(stop_server, server, task, svc.drain_seconds, log)
    log.info(
        "%s serving the OpenAI and Anthropic APIs on %s:%d (ops: /healthz, /metrics, /status "
        "on port %d) "
        "for model %s via entrypoint %s",
        svc.instance_id,
        svc.host,
        cfg.port,
        ops_port,
        cfg.app.model_name,
        cfg.entrypoint_address,
    )
    warn_if_unsalted(cfg.app.labels, log)
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
        limits = cfg.app.key_limits
        log.info(
            "per-key limits: %s concurrent, %s tokens/min (0: none); %d keys overridden",
            limits.default.concurrency,
            limits.default.tokens_per_min,
            len(limits.overrides),
        )
    stopping = asyncio.create_task(ctx.stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done() and not server.started:
        log.error("could not start the HTTP server on %s:%d", svc.host, cfg.port)
        return 1
    return 0


def _limiter(cfg: RecipeConfig, ctx: ServiceContext) -> KeyCaps:
    """The keys' limits: shared with every replica through Redis when --redis-url is set."""
    if not cfg.shared.redis_url:
        if not cfg.app.keys.open:
            ctx.log.warning(
                "no --redis-url: per-key limits are this replica's own (R replicas allow a key "
                "R times its limits)"
            )
        return KeyCaps(cfg.app.key_limits)
    client = open_redis(cfg.shared.redis_url)
    ctx.stack.push_async_callback(client.aclose)
    limiter = KeyCaps(cfg.app.key_limits, client, slot_ttl_s=cfg.shared.slot_ttl_s, log=ctx.log)
    ctx.background(limiter.renew_forever(ctx.stop), "key-slots")
    return limiter
