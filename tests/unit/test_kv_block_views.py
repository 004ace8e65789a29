"""Whole blocks in a few tensor ops (libs/engine/kv/block_views.py): what the kvstore export,
the import and the peer copy move must be exactly the bytes of every entry of every layer,
block-major, for the bf16 layout, the FP8 one (three entries a layer) and a pool whose
entries do not repeat (widths that differ by layer)."""

from __future__ import annotations

import pytest
import torch

from libs.engine.kv.block_views import pattern_period
from libs.engine.kv.cache import PagedKVCache
from libs.engine.kv.layout import FP8, CacheSpec, PagedEntry

BS = 4
LAYERS = 3


def bf16() -> CacheSpec:
    return CacheSpec("m", BS, tuple(PagedEntry("mla", i, (24,), "bfloat16") for i in range(LAYERS)))


def fp8() -> CacheSpec:
    return CacheSpec(
        "m",
        BS,
        tuple(
            e
            for i in range(LAYERS)
            for e in (
                PagedEntry("mla_latent", i, (16,), FP8),
                PagedEntry("mla_scale", i, (1,), "float32"),
                PagedEntry("mla_rope", i, (8,), "bfloat16"),
            )
        ),
    )


def uneven() -> CacheSpec:  # widths differ by layer: nothing repeats
    return CacheSpec(
        "m", BS, tuple(PagedEntry("mla", i, (8 * (i + 1),), "bfloat16") for i in range(3))
    )


SPECS = {"bf16": (bf16, 1), "fp8": (fp8, 3), "uneven": (uneven, 3)}


def filled(spec: CacheSpec, num_blocks: int = 8, seed: int = 0) -> PagedKVCache:
    cache = PagedKVCache(spec, num_blocks, torch.device("cpu"), rope_dim=0)
    g = torch.Generator().manual_seed(seed)
    cache.backing.copy_(torch.randint(0, 256, cache.backing.shape, dtype=torch.uint8, generator=g))
    return cache


def reference(cache: PagedKVCache, blocks: list[int]) -> bytes:
    """Block by block, every entry's tokens of that block in spec order (one tensor each)."""
    out = b""
    for b in blocks:
        for t in cache.tensors:
            rows = t[b * BS : (b + 1) * BS].contiguous().view(torch.uint8)
            out += rows.numpy().tobytes()
    return out


@pytest.mark.parametrize("name", SPECS)
def test_a_layouts_pattern_is_found_once_per_layer(name: str) -> None:
    make, period = SPECS[name]
    cache = filled(make())
    assert pattern_period(cache.spec, cache.offsets) == period
    assert len(cache.blocks) == period


@pytest.mark.parametrize("name", SPECS)
def test_read_blocks_gives_every_entrys_bytes_block_by_block(name: str) -> None:
    cache = filled(SPECS[name][0]())
    blocks = [5, 0, 3, 3]
    got = cache.read_blocks(blocks)
    assert len(got) == len(blocks) * cache.spec.bytes_per_block
    assert got == reference(cache, blocks)
    assert cache.gather_async(blocks).result() == got


@pytest.mark.parametrize("name", SPECS)
def test_write_blocks_lands_in_those_blocks_and_nowhere_else(name: str) -> None:
    cache = filled(SPECS[name][0]())
    before = {b: reference(cache, [b]) for b in range(cache.num_blocks + 1)}
    payload = filled(cache.spec, seed=1).read_blocks([1, 6])
    cache.write_blocks([6, 2], payload)
    assert cache.read_blocks([6, 2]) == payload
    for b, raw in before.items():
        if b not in (6, 2):
            assert reference(cache, [b]) == raw, f"block {b} changed"


@pytest.mark.parametrize("name", SPECS)
def test_a_peer_copy_moves_the_blocks_bytes(name: str) -> None:
    spec = SPECS[name][0]()
    src, dst = filled(spec, num_blocks=6, seed=2), filled(spec, num_blocks=9, seed=3)
    handle = src.share()
    assert handle is not None
    untouched = dst.read_blocks([0])
    dst.copy_from_peer(dst.open_peer(handle), [4, 1], [7, 3])
    assert dst.read_blocks([7, 3]) == src.read_blocks([4, 1])
    assert dst.read_blocks([0]) == untouched
