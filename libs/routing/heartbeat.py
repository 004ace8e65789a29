"""The routing policy's messages: a heartbeat (``InstanceStatus`` on
``ds.heartbeat.<role>.<id>``) in, a ``RouteRequest`` routed, a ``RouteDecision`` out.

One conversion for every process that routes: the balancer, and the entrypoint while no
balancer answers (``services/entrypoint/last_view.py``).
"""

from __future__ import annotations

from libs.proto.deepserve.v1 import control_pb2

from .policy import DECODE, DIGEST_BYTES, PREFILL, Decision, Instance, RoutingPolicy

_ROLE_NAMES = {control_pb2.ROLE_PREFILL: PREFILL, control_pb2.ROLE_DECODE: DECODE}


def role_of(status: control_pb2.InstanceStatus) -> str:
    """The heartbeat's role (``PREFILL`` or ``DECODE``); ValueError if it names none."""
    role = _ROLE_NAMES.get(status.role)
    if role is None:
        raise ValueError(f"heartbeat of {status.instance_id!r} has no role")
    return role


def instance_from_status(status: control_pb2.InstanceStatus) -> Instance:
    """The routing view of a heartbeat; ValueError if it names no valid role or instance."""
    role = role_of(status)
    return Instance(
        instance_id=status.instance_id,
        role=role,
        model=status.model,
        address=status.address,
        running=status.running,
        waiting=status.waiting,
        queued_tokens=status.queued_tokens,
        free_kv_blocks=status.free_kv_blocks,
        total_kv_blocks=status.total_kv_blocks,
        draining=status.draining,
        resident=frozenset(bytes(p[:DIGEST_BYTES]) for p in status.resident_prefixes),
        promised_kv_blocks=status.promised_kv_blocks,
    )


def route(policy: RoutingPolicy, req: control_pb2.RouteRequest) -> Decision:
    """``policy``'s decision for a route request; NoInstance if nothing live can take it."""
    return policy.route(
        req.model,
        req.exclude,
        request_id=req.request_id,
        prompt_tokens=req.prompt_tokens,
        block_hashes=list(req.block_hashes),
    )


def decision_message(decision: Decision) -> control_pb2.RouteDecision:
    """A decision as the ``RouteDecision`` its requester reads."""
    return control_pb2.RouteDecision(
        prefill_instance=decision.prefill.instance_id,
        decode_instance=decision.decode.instance_id,
        decode_address=decision.decode.address,
    )
