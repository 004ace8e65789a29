"""The standard services every deepserve gRPC server carries, so any backend can find and
probe it with stock tools (``grpcurl``, ``grpc_health_probe``, Kubernetes gRPC probes):

* ``grpc.health.v1.Health`` -- per-service status, ``""`` for the server as a whole;
  ``enter_graceful_shutdown()`` turns every status NOT_SERVING when a drain starts.
* ``grpc.reflection.v1alpha.ServerReflection`` -- lists the services and serves their
  descriptors (the protos in proto/deepserve/v1), so clients need no copy of them.

Both are exempt from the service token (:data:`libs.common.grpc_auth.EXEMPT`): they reveal
nothing a caller could not read in this repository.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def new_health(
    service_names: Sequence[str], status: int = SERVING
) -> health_aio.HealthServicer:
    """A health servicer with ``status`` for ``""`` and each of ``service_names``.

    Create it first (and pass it to :func:`add_health_and_reflection`) when readiness follows
    something other than the server's start, e.g. the kvstore's Redis ping."""
    health = health_aio.HealthServicer()
    for name in ("", *service_names):
        await health.set(name, status)
    return health


async def add_health_and_reflection(
    server: grpc.aio.Server,
    service_names: Sequence[str],
    health: health_aio.HealthServicer | None = None,
) -> health_aio.HealthServicer:
    """Register health and reflection on ``server`` (before ``server.start()``).

    ``service_names`` are the full names of the application services (``deepserve.v1.KVStore``)
    whose descriptors must already be imported (the ``*_pb2`` module). Without ``health`` a new
    one says SERVING for ``""`` and each name; the caller owns it and calls
    ``enter_graceful_shutdown()`` when draining."""
    if health is None:
        health = await new_health(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (*service_names, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return health
