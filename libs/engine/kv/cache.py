"""Paged KV tensors laid out by a :class:`CacheSpec`, and block (de)serialization."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import CacheSpec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float8_e4m3fn": torch.float8_e4m3fn}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class PagedKVCache:
    """One tensor per paged entry, [num_blocks * block_size, *token_shape]."""

    def __init__(self, spec: CacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = device
        bs = spec.block_size
        self.tensors = [torch.zeros(num_blocks * bs, *e.token_shape, dtype=TORCH_DTYPES[e.dtype],
                                    device=device) for e in spec.paged]

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
        parts = [t.index_select(0, slots).reshape(n, -1).contiguous().view(torch.uint8)
                 for t in self.tensors]
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
