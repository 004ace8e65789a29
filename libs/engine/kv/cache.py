"""Paged KV tensors laid out by a :class:`CacheSpec`, and block (de)serialization."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import CacheSpec

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of ``x`` [N, D]: ``(x / scale as e4m3, scale [N] fp32)``.

    ``scale = amax / 448`` per row (a zero row gets the smallest normal scale and stays zero),
    so ``q.float() * scale[:, None]`` approximates ``x``. Plain tensor ops, graph-capturable.
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@dataclass
class LayerCache:
    """One attention layer's pages as the model reads and writes them.

    ``kv`` [slots, r + rope] holds both parts in one dtype (``latent``/``rope`` are column
    views of it); the FP8 layout has e4m3 ``latent`` [slots, r], float32 ``scale`` [slots]
    and bfloat16 ``rope`` [slots, rope] instead (``kv`` is None).
    """

    latent: torch.Tensor
    rope: torch.Tensor
    kv: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.scale is not None

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` [n, r + rope] (latent then rotated key) at ``slots``."""
        if self.kv is not None:
            self.kv.index_copy_(0, slots, values.to(self.kv.dtype))
            return
        assert self.scale is not None
        r = self.latent.shape[1]
        q, scale = quantize_fp8(values[:, :r])
        # Through a byte view: index_copy_ has no float8 kernel on every device.
        self.latent.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
        self.scale.index_copy_(0, slots, scale)
        self.rope.index_copy_(0, slots, values[:, r:].to(self.rope.dtype))

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values at ``slots`` (any index shape) as [..., r + rope] in ``dtype``, dequantized."""
        if self.kv is not None:
            return self.kv[slots].to(dtype)
        assert self.scale is not None
        latent = self.latent.view(torch.uint8)[slots].view(torch.float8_e4m3fn).to(
            torch.float32
        ) * self.scale[slots].unsqueeze(-1)
        return torch.cat((latent.to(dtype), self.rope[slots].to(dtype)), dim=-1)


TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class PagedKVCache:
    """One tensor per paged entry, [(num_blocks + 1) * block_size, *token_shape].

    The extra block after the managed ones is scratch: padding rows of a CUDA-graph batch
    write there (``scratch_slot``), so they never touch a request's pages.
    """

    def __init__(
        self, spec: CacheSpec, num_blocks: int, device: torch.device, rope_dim: int
    ) -> None:
        self.spec = spec
        self.rope_dim = rope_dim
        self.num_blocks = num_blocks
        self.device = device
        bs = spec.block_size
        self.scratch_slot = num_blocks * bs
        self.tensors = [
            torch.zeros(
                (num_blocks + 1) * bs, *e.token_shape, dtype=TORCH_DTYPES[e.dtype], device=device
            )
            for e in spec.paged
        ]
        self.layers = self._layer_views()

    def _layer_views(self) -> list[LayerCache]:
        by_layer: dict[int, dict[str, torch.Tensor]] = {}
        for entry, t in zip(self.spec.paged, self.tensors):
            by_layer.setdefault(entry.layer, {})[entry.name] = t
        views = []
        for layer in sorted(by_layer):
            parts = by_layer[layer]
            if "mla" in parts:
                kv = parts["mla"]
                r = kv.shape[1] - self.rope_dim
                views.append(LayerCache(kv[:, :r], kv[:, r:], kv=kv))
            else:
                views.append(
                    LayerCache(
                        parts["mla_latent"], parts["mla_rope"], scale=parts["mla_scale"].view(-1)
                    )
                )
        return views

    def _slots(self, blocks: Sequence[int]) -> torch.Tensor:
        bs = self.spec.block_size
        b = torch.tensor(list(blocks), dtype=torch.int64, device=self.device)
        return (b[:, None] * bs + torch.arange(bs, device=self.device)[None, :]).reshape(-1)

    def read_blocks(self, blocks: Sequence[int]) -> bytes:
        """Block-major bytes: for each block, its slice of every entry in spec order."""
        if not blocks:
            return b""
        slots = self._slots(blocks)
        n = len(blocks)
        parts = [
            t.index_select(0, slots).reshape(n, -1).contiguous().view(torch.uint8)
            for t in self.tensors
        ]
        return torch.cat(parts, dim=1).cpu().numpy().tobytes()

    def write_blocks(self, blocks: Sequence[int], payload: bytes | memoryview) -> None:
        n = len(blocks)
        if not n:
            return
        bpb = self.spec.bytes_per_block
        if len(payload) != n * bpb:
            raise ValueError(f"payload is {len(payload)} bytes, expected {n} x {bpb}")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(n, bpb).to(self.device)
        slots = self._slots(blocks)
        off = 0
        for entry, t in zip(self.spec.paged, self.tensors):
            width = entry.bytes_per_block(self.spec.block_size)
            chunk = raw[:, off : off + width].contiguous().view(t.dtype).view(-1, *t.shape[1:])
            t.index_copy_(0, slots, chunk)
            off += width
