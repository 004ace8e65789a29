"""What ``deepserve up`` tells people and tools about a stack: the lines it prints when it
starts and once it is up, and ``<run_dir>/stack.json`` (what runs and where it listens)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from deepserve.children import HOST
from libs.common.redact import redact

if TYPE_CHECKING:
    from deepserve.up import Stack


def starting_line(stack: Stack, ep: int) -> str:
    """The line before the start: which engines, where, in which mode, where the logs go."""
    where = ", ".join(
        f"{p.name} {p.device}"
        + (f" {','.join(map(str, p.ep_gpus))}" if p.ep_gpus else "")
        + (f" ({p.gpu_memory_fraction:g})" if p.gpu_memory_fraction is not None else "")
        for p in stack.placements
    )
    if ep > 1:
        where += f"; {ep} expert-parallel ranks each"
    engines = (
        f"{len(stack.placements)} aggregated (prefill + decode in one engine)"
        if stack.mode == "aggregated"
        else f"{stack.prefill} prefill + {stack.decode} decode"
    )
    return (
        f"deepserve: starting {engines} ({stack.model}: {where}); mode {stack.mode}; "
        f"logs in {stack.run_dir / 'logs'}"
    )


def chosen(stack: Stack) -> list[str]:
    """What ``up`` chose, for the operator: mode, engines per GPU, each engine's KV room."""
    per_device: dict[str, list[str]] = {}
    for p in stack.placements:
        per_device.setdefault(p.device, []).append(p.name)
    out = [
        f"mode {stack.mode}: "
        + "; ".join(f"{d}: {len(n)} engine(s) ({', '.join(n)})" for d, n in per_device.items())
    ]
    if stack.mps:
        out.append(f"MPS {stack.mps}")
    for iid, (n, bs) in sorted(stack.kv_blocks.items()):
        out.append(f"{iid}: {n} KV blocks of {bs} tokens ({n * bs:,} tokens)")
    return out


def up_lines(stack: Stack) -> list[str]:
    """The lines once the stack is up: its URL, what was chosen, where everything listens
    (URLs with their passwords redacted)."""
    recipe = next(c for c in stack.children if c.service == "recipe")
    return [
        f"deepserve is up: {stack.api_url}  (model {stack.model_name})",
        *(f"  {line}" for line in chosen(stack)),
        f"  gRPC Generate: {stack.grpc_address}   NATS: {redact(stack.nats_url)}   "
        f"Redis: {redact(stack.redis_url)}",
        f"  status page: http://{HOST}:{recipe.ops_port}/status",
        f"  where each service listens: {stack.run_dir / 'stack.json'}",
    ]


def state(stack: Stack) -> dict[str, Any]:
    """stack.json's content: every process started, where each service listens, their
    restarts. Names the tools user's NATS URL, never a secret of the stack."""
    return {
        "api_url": stack.api_url if stack.api_base else "",
        "grpc_address": stack.grpc_address,  # the entrypoint's Generate
        "kvstore_address": stack.kvstore_address,
        "decode_addresses": {
            c.name: f"{HOST}:{c.grpc_port}"
            for c in stack.children
            if c.service in ("decode", "aggregated")
        },
        "mode": stack.mode,
        "mps": stack.mps,
        # tools' credentials (deepserve usage), not admin's
        "nats_url": stack.backends.tools_url(),
        "backend_restarts": stack.backend_restarts,
        "redis_url": stack.redis_url,
        "supervisor_pid": os.getpid(),
        "pids": {
            **stack.backends.pids(),
            **{c.name: c.pid for c in stack.children if c.proc is not None},
        },
        "instance_ids": stack.instance_ids,
        # where each service serves /healthz and /metrics
        "ops_ports": {c.name: c.ops_port for c in stack.children},
        "services": {
            c.name: {
                "service": c.service,
                "instance_id": c.instance_id,
                "ep": c.ep,
                # the ids its ranks heartbeat under (its first group's; a later group's:
                # <id>-r<k>-g<gen>, listed by its /healthz)
                "rank_ids": c.rank_ids,
                "pid": c.pid if c.proc is not None else None,
                "status": c.status(),
                "ops_port": c.ops_port,
                "grpc_address": f"{HOST}:{c.grpc_port}" if c.grpc_port else "",
                "restarts": c.restarts,
                "last_exit_code": c.last_exit_code,
                "log": str(c.log_path),
            }
            for c in stack.children
        },
    }


def write_state(stack: Stack) -> None:
    """``<run_dir>/stack.json``: what runs and where it listens, for local tools.

    The NATS and Redis URLs are written as given (a tool needs them usable), so the file
    is created owner-only (0600), like the run dir's other state; the stack's secrets are
    never written.
    """
    tmp = stack.run_dir / "stack.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(state(stack), indent=2))
    tmp.replace(stack.run_dir / "stack.json")
