"""The project's one definition of the prefix hash chain.

Every component that names a KV block by its content -- the engine's prefix cache, the
kvstore's keys, the entrypoint's lookups, the balancer's locality summaries -- calls
:func:`chain_hashes` here and nowhere else, so a block computed on one host is found by the
same name on every other host.

Definition (version 1)::

    root   = SHA-256(b"deepserve/kv-chain/v1" || u32(block_size) || u32(len(salt)) || salt)
    h[i]   = SHA-256(h[i-1] || u32le(token) for each token of block i)     (h[-1] = root)

* deterministic across processes and hosts (no Python ``hash()``, fixed byte order);
* collision-resistant (SHA-256), and a block's name commits to every token before it;
* salted: two tenants with different salts never share names, so one tenant cannot probe
  another's prompts through cache timing. The empty salt is the shared namespace.

Only full blocks get names unless ``include_partial`` is set; a partial tail is named the
same way (used to check KV handed over mid-block, never to index a cache).

No I/O and no heavy imports: policy code imports this freely.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

DIGEST_SIZE = 32
_DOMAIN = b"deepserve/kv-chain/v1"
_MAX_TOKEN = 0xFFFFFFFF


def chain_root(block_size: int, salt: bytes = b"") -> bytes:
    """The digest every chain starts from, for this block size and salt."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    h = hashlib.sha256()
    h.update(_DOMAIN)
    h.update(struct.pack("<II", block_size, len(salt)))
    h.update(salt)
    return h.digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Digest of one block given its parent's digest (or the chain root)."""
    if len(parent) != DIGEST_SIZE:
        raise ValueError(f"parent digest must be {DIGEST_SIZE} bytes, got {len(parent)}")
    h = hashlib.sha256(parent)
    try:
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN}]: {exc}") from None
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int = 128,
    salt: bytes = b"",
    *,
    include_partial: bool = False,
    start: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Digests of the blocks of ``token_ids``, one per full block (plus the tail if asked).

    ``start``/``parent`` continue an existing chain: pass the index of the first block to hash
    and the digest of the block before it, to extend a chain without rehashing its prefix.
    """
    prev = parent if parent is not None else chain_root(block_size, salt)
    if start and parent is None:
        raise ValueError("continuing a chain at start > 0 needs the parent digest")
    n_full = len(token_ids) // block_size
    out: list[bytes] = []
    for i in range(start, n_full):
        prev = block_hash(prev, token_ids[i * block_size : (i + 1) * block_size])
        out.append(prev)
    if include_partial and len(token_ids) % block_size:
        out.append(block_hash(prev, token_ids[n_full * block_size :]))
    return out


_SALT_DOMAIN = b"deepserve/tenant-salt/v1/"
SALT_SIZE = 16


def tenant_salt(secret: bytes, tenant: str) -> bytes:
    """The salt that names ``tenant``'s blocks: a keyed hash (HMAC-SHA-256) of the tenant under
    a secret only the serving tier holds, so a block's name reveals nothing about its tenant
    and nobody without the secret can compute a tenant's names offline. Changing the secret
    renames every tenant's blocks at once (every cached prefix becomes a miss)."""
    if not secret:
        raise ValueError("the tenant-salt secret must not be empty")
    return hmac.new(secret, _SALT_DOMAIN + tenant.encode(), hashlib.sha256).digest()[:SALT_SIZE]
