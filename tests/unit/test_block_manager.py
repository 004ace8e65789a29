from __future__ import annotations

import random

import pytest

from libs.engine.kv.block_manager import BlockManager, NoFreeBlocks


def names(n: int, tag: str = "") -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b".") for i in range(n)]


def test_allocate_release_accounting_is_exact() -> None:
    bm = BlockManager(8, 16)
    a = bm.allocate(5)
    assert bm.num_free == 3 and bm.num_used == 5
    with pytest.raises(NoFreeBlocks):
        bm.allocate(4)
    assert bm.num_free == 3  # a failed allocation takes nothing
    bm.release(a)
    assert bm.num_free == 8
    bm.check()


def test_prefix_reuse_with_reference_counts() -> None:
    bm = BlockManager(8, 16)
    blocks = bm.allocate(3)
    for b, h in zip(blocks, names(3)):
        bm.register(b, h)
    assert bm.match_prefix(names(3) + names(1, "x")) == blocks
    bm.acquire(blocks[:2])  # a second request shares the first two blocks
    assert [bm.ref_count(b) for b in blocks] == [2, 2, 1]
    bm.release(blocks)
    assert [bm.ref_count(b) for b in blocks] == [1, 1, 0] and bm.num_free == 6
    # The released third block is still findable until its page is reused.
    assert bm.match_prefix(names(3)) == blocks
    bm.check()


def test_lru_evicts_tail_blocks_before_their_prefix() -> None:
    bm = BlockManager(4, 16)
    blocks = bm.allocate(4)
    for b, h in zip(blocks, names(4)):
        bm.register(b, h)
    bm.release(blocks)  # tail first into the LRU queue
    bm.allocate(1)
    assert bm.match_prefix(names(4)) == blocks[:3]
    bm.allocate(1)
    assert bm.match_prefix(names(4)) == blocks[:2]
    bm.check()


def test_freed_prefix_block_is_revived_by_acquire() -> None:
    bm = BlockManager(4, 16)
    (b,) = bm.allocate(1)
    bm.register(b, names(1)[0])
    bm.release([b])
    bm.acquire([b])
    assert bm.ref_count(b) == 1 and bm.num_free == 3
    assert bm.allocate(3) and bm.match_prefix(names(1)) == [b]  # not evicted: it is in use
    bm.check()


def test_duplicate_names_keep_the_first_block() -> None:
    bm = BlockManager(4, 16)
    a, b = bm.allocate(2)
    h = names(1)[0]
    assert bm.register(a, h) == a
    assert bm.register(b, h) == a and bm.block_hash(b) is None


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(0)
    bm = BlockManager(32, 16)
    held: list[list[int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and bm.num_free:
            got = bm.allocate(rng.randint(1, min(4, bm.num_free)))
            for b in got:
                if rng.random() < 0.5:
                    bm.register(b, f"{step}-{b}".encode())
            held.append(got)
        elif op < 0.6 and held:
            reuse = rng.choice(held)
            bm.acquire(reuse)
            held.append(list(reuse))
        elif held:
            bm.release(held.pop(rng.randrange(len(held))))
        bm.check()
        assert bm.num_free + bm.num_used == 32
    for h in held:
        bm.release(h)
    assert bm.num_free == 32


def test_double_release_is_an_error() -> None:
    bm = BlockManager(2, 16)
    (b,) = bm.allocate(1)
    bm.release([b])
    with pytest.raises(AssertionError):
        bm.release([b])
