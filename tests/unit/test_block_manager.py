from __future__ import annotations

import random
from collections import Counter

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


def _accounting(bm: BlockManager, holders: dict[str, list[int]]) -> None:
    """The manager's counts against an independent tally of who holds which block: a block is
    used exactly while someone holds it, with one reference per holder, and free otherwise."""
    refs = Counter(b for blocks in holders.values() for b in blocks)
    assert bm.num_used == len(refs)
    assert bm.num_free == bm.num_blocks - len(refs)
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == [
        refs[b] for b in range(bm.num_blocks)
    ]
    bm.check()


def test_block_accounting_is_exact_through_reuse_preemption_and_release() -> None:
    """A scripted life of three requests over 6 blocks, the tally checked after every step:
    a prompt named and shared, a second request preempted (everything released at once) and
    recomputed on top of the cached prefix, eviction of cached pages, and everything released
    at the end."""
    bm = BlockManager(6, 16)
    held: dict[str, list[int]] = {}
    prefix = names(3, "p")
    held["a"] = bm.allocate(3)
    for b, h in zip(held["a"], prefix):
        assert bm.register(b, h) == b
    _accounting(bm, held)
    assert bm.num_cached == 3

    hits = bm.match_prefix(prefix[:2] + names(1, "b"))  # b shares a's first two blocks
    assert hits == held["a"][:2]
    bm.acquire(hits)
    held["b"] = hits + bm.allocate(2)
    _accounting(bm, held)
    assert bm.num_free == 1 and [bm.ref_count(b) for b in held["b"]] == [2, 2, 1, 1]

    with pytest.raises(NoFreeBlocks):  # c needs 2: the most recent request is preempted
        bm.allocate(2)
    _accounting(bm, held)
    bm.release(held.pop("b"))
    _accounting(bm, held)
    assert bm.num_free == 3 and [bm.ref_count(b) for b in held["a"]] == [1, 1, 1]
    held["c"] = bm.allocate(2)
    _accounting(bm, held)

    a_blocks = held.pop("a")
    bm.release(a_blocks)  # a finishes: its named pages stay findable while free
    _accounting(bm, held)
    assert bm.num_free == 4 and bm.match_prefix(prefix) == a_blocks

    hits = bm.match_prefix(prefix[:2])  # b comes back: its prefix is revived, not recomputed
    assert hits == a_blocks[:2]
    bm.acquire(hits)
    held["b"] = hits + bm.allocate(2)  # takes the free pages, evicting a's third named one
    _accounting(bm, held)
    assert bm.num_free == 0 and len(bm.match_prefix(prefix)) == 2 and bm.num_cached == 2

    for rid in ("c", "b"):
        bm.release(held.pop(rid))
        _accounting(bm, held)
    assert bm.num_free == 6 and bm.num_used == 0
