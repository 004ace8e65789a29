"""The routing view of a heartbeat (``InstanceStatus`` on ``ds.heartbeat.<role>.<id>``).

One conversion for every process that routes: the balancer, and the entrypoint while no
balancer answers (``services/entrypoint/last_view.py``).
"""

from __future__ import annotations

from libs.proto.deepserve.v1 import control_pb2

from .policy import DECODE, DIGEST_BYTES, PREFILL, Instance

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
    )
