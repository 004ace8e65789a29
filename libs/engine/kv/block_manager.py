"""Block manager: reference counts, prefix reuse by hash chain, LRU reuse of free blocks.

Contract:

* A block is *in use* while its reference count is positive. Only the request(s) holding a
  reference may write it, and only while it is not full-and-registered: a registered block is
  immutable (its content is what its hash names).
* A full block gets a name (the hash chain, :mod:`libs.common.hashchain`) with
  :meth:`register`; named blocks stay findable after their last reference is released, until
  their page is reused for something else.
* Free blocks (count 0) wait in one LRU queue; :meth:`allocate` takes the least recently
  released and drops its name then. Releasing a request's blocks in reverse order puts its
  tail blocks ahead of its prefix, so shared prefixes outlive the tails that extend them.
* Accounting is exact: ``num_free + num_used == num_blocks`` at all times, and every block
  is either free or has a positive count.

No I/O, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class NoFreeBlocks(RuntimeError):
    """Not enough free blocks for an allocation (recoverable: preempt or wait)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks available to :meth:`allocate` (including cached, evictable ones)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Named blocks, in use or not."""
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def block_hash(self, block: int) -> bytes | None:
        return self._hash_of[block]

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes`` (no references taken)."""
        out: list[int] = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def recent_names(self, n: int) -> list[bytes]:
        """Names of up to ``n`` cached blocks no request holds, most recently released first.

        These are the ones a prefix hit would find soonest evicted last; blocks in use are
        not listed (their requests know them). Scans at most ``4 * n`` free blocks, so the
        cost is bounded however large the pool is (it runs on every engine step).
        """
        out: list[bytes] = []
        for i, b in enumerate(reversed(self._free)):
            if len(out) >= n or i >= 4 * n:
                break
            name = self._hash_of[b]
            if name is not None:
                out.append(name)
        return out

    # -- changes ------------------------------------------------------------------------------
    def acquire(self, blocks: Iterable[int]) -> None:
        """Take a reference on existing blocks (a prefix hit); pulls free ones out of the LRU."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with count 1, evicting the least recently freed names."""
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            name = self._hash_of[b]
            if name is not None:
                del self._block_of[name]
                self._hash_of[b] = None
            self._refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the LRU queue.

        Blocks are queued in reverse order so a request's tail is evicted before its prefix.
        """
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise AssertionError(f"block {b} released more often than acquired")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    def register(self, block: int, name: bytes) -> int:
        """Name a full block; returns the block that now holds the name.

        If another block already holds the same name (two requests computed the same prefix
        at once), the existing one keeps it and ``block`` stays unnamed.
        """
        if self._refs[block] <= 0:
            raise AssertionError(f"cannot name free block {block}")
        existing = self._block_of.get(name)
        if existing is not None:
            return existing
        if self._hash_of[block] is not None:
            raise AssertionError(f"block {block} already named")
        self._hash_of[block] = name
        self._block_of[name] = block
        return block

    def check(self) -> None:
        """Verify the accounting invariants (tests and debug builds)."""
        free = set(self._free)
        for b in range(self.num_blocks):
            assert (self._refs[b] == 0) == (b in free), f"block {b}: refs {self._refs[b]}"
        for name, b in self._block_of.items():
            assert self._hash_of[b] == name
