"""The KV cache layout as data.

A :class:`CacheSpec` lists every paged entry (one per attention layer for MLA: the latent
plus the rotated key, ``kv_cache_dim`` values per token) with its bytes per block, and the
per-request state kept outside the pages (none for V3; DeepSeek-V4's sliding-window rings
and compression state go there). Block managers, exporters and the kvstore size and check
blocks from this spec alone, so a new cache kind is a new spec, not new plumbing.

No torch here: dtypes are named by string.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from ..config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "uint8": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported cache dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}"
        ) from None


@dataclass(frozen=True)
class PagedEntry:
    """One cache tensor paged in blocks: ``token_shape`` values of ``dtype`` per token."""

    name: str
    layer: int
    token_shape: tuple[int, ...]
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        n = 1
        for d in self.token_shape:
            n *= d
        return n * dtype_bytes(self.dtype)

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


@dataclass(frozen=True)
class StateEntry:
    """Per-request state outside the pages (fixed size per request)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class CacheSpec:
    model_id: str
    block_size: int
    paged: tuple[PagedEntry, ...]
    state: tuple[StateEntry, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.paged:
            raise ValueError("a cache spec needs at least one paged entry")

    @property
    def bytes_per_block(self) -> int:
        return sum(e.bytes_per_block(self.block_size) for e in self.paged)

    @property
    def dtype(self) -> str:
        kinds = {e.dtype for e in self.paged}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def layout_hash(self) -> str:
        """Digest of everything that decides how block bytes are laid out and read."""
        blob = json.dumps(
            {
                "block_size": self.block_size,
                "paged": [asdict(e) for e in self.paged],
                "state": [asdict(s) for s in self.state],
                "model_id": self.model_id,
            },
            sort_keys=True,
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


FP8 = "float8_e4m3fn"


def mla_cache_spec(
    cfg: ModelConfig,
    model_id: str,
    block_size: int = 128,
    dtype: str = "bfloat16",
    num_layers: int | None = None,
) -> CacheSpec:
    """The DeepSeek-V3 MLA layout.

    Per layer, one entry ``mla`` of latent (kv_lora_rank) + rotated key (rope dim) values in
    ``dtype`` -- or, for ``float8_e4m3fn``, three entries: ``mla_latent`` (e4m3 latent),
    ``mla_scale`` (one float32 dequantization scale per token: latent = e4m3 * scale) and
    ``mla_rope`` (the rotated key kept in bfloat16, where position information lives). That
    is 644 bytes per token and layer for V3's 512 + 64 instead of 1,152 in bfloat16.
    """
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    dtype_bytes(dtype)
    if dtype == FP8:
        paged = tuple(
            e
            for i in range(layers)
            for e in (
                PagedEntry("mla_latent", i, (cfg.kv_lora_rank,), FP8),
                PagedEntry("mla_scale", i, (1,), "float32"),
                PagedEntry("mla_rope", i, (cfg.qk_rope_head_dim,), "bfloat16"),
            )
        )
    else:
        paged = tuple(PagedEntry("mla", i, (cfg.kv_cache_dim,), dtype) for i in range(layers))
    return CacheSpec(model_id=model_id, block_size=block_size, paged=paged)
