"""Whole blocks of a paged pool in a few tensor ops, whatever its number of layers.

A pool's entries (:func:`~.cache.pool_offsets`) usually repeat one pattern per layer: V2/V3's
one ``mla`` entry, or FP8's latent, rope and scale. Viewed as bytes, entry ``j`` of the
pattern in every layer is then one strided tensor ``[num_blocks + 1, layers, block bytes of
j]`` over the pool's buffer (a block's bytes of one entry are contiguous; the layers sit a
fixed distance apart). Copying ``n`` blocks out is one ``index_select`` per pattern entry and
a concatenation, and in one ``index_copy_`` each -- instead of a gather per entry of every
layer (60 layers: 60-180 launches for each kvstore export, import and peer copy).

The block-major byte layout is :meth:`~.cache.PagedKVCache.read_blocks`' (for each block, its
slice of every entry in spec order), so the views change no format. A pool whose entries do
not repeat is one "pattern" of all of them, one layer.
"""

from __future__ import annotations

import torch

from .layout import CacheSpec


def pattern_period(spec: CacheSpec, offsets: list[int]) -> int:
    """The fewest leading entries that the rest repeat, entry by entry and at one fixed byte
    distance per repetition (all of them: no repetition)."""
    entries = spec.paged
    n = len(entries)
    for p in range(1, n):
        if n % p:
            continue
        stride = offsets[p] - offsets[0]
        if all(
            (entries[i].name, entries[i].token_shape, entries[i].dtype)
            == (entries[i - p].name, entries[i - p].token_shape, entries[i - p].dtype)
            and offsets[i] - offsets[i - p] == stride
            for i in range(p, n)
        ):
            return p
    return n


def block_views(
    backing: torch.Tensor, spec: CacheSpec, num_blocks: int, offsets: list[int]
) -> list[torch.Tensor]:
    """Per pattern entry: ``[num_blocks + 1, repetitions, its bytes per block]`` uint8 views
    of ``backing`` (a flat uint8 buffer, the entries at ``offsets``)."""
    p = pattern_period(spec, offsets)
    reps = len(spec.paged) // p
    stride = offsets[p] - offsets[0] if reps > 1 else 0
    base = backing.storage_offset()
    views = []
    for j in range(p):
        width = spec.paged[j].bytes_per_block(spec.block_size)
        views.append(
            backing.as_strided((num_blocks + 1, reps, width), (width, stride, 1), base + offsets[j])
        )
    return views


def gather(views: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``ids`` (int64 on the views' device) as ``[n, bytes_per_block]`` uint8,
    block-major."""
    parts = [v.index_select(0, ids) for v in views]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.reshape(len(ids), -1)


def scatter(views: list[torch.Tensor], ids: torch.Tensor, raw: torch.Tensor) -> None:
    """Write ``raw`` (``[n, bytes_per_block]`` uint8, block-major) into blocks ``ids``."""
    reps = views[0].shape[1]
    rows = raw.reshape(len(ids), reps, -1)
    off = 0
    for v in views:
        width = v.shape[2]
        v.index_copy_(0, ids, rows[:, :, off : off + width])
        off += width
