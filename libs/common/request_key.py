"""A request's 64-bit key: what an engine's heartbeat lists for each request it holds, and
what the entrypoint looks up to know that a request it sent is already in the engine's own
figures (``InstanceStatus.held_requests``). Eight bytes of BLAKE2b of the attempt id: 256
requests cost 2 KiB a heartbeat, and two attempts share a key with odds of ~2^-64."""

from __future__ import annotations

import hashlib


def request_key(request_id: str) -> int:
    """The unsigned 64-bit key of ``request_id`` (a ``fixed64`` on the wire)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
