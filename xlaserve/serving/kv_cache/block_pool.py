"""The physical KV blocks: ref counts, the free lists and the hash -> block map.

Every usable block is in exactly one of three states:

    in use       ref > 0      held by one or more request block tables (shared when > 1)
    cached free  ref == 0     has a hash: its contents can still be reused by a prefix hit
    free         ref == 0     no hash: contents are garbage

              allocate()                          free() [has hash]
    free --------------------> in use -------------------------------> cached free
      ^                        ^    |                                     |    |
      |                        |    +----------- free() [no hash] --------|----+--> free
      |                        +------------ share() (prefix hit) --------+
      +---- (evicted: hash dropped) --- allocate() when `free` is empty --+

`allocate` takes uncached free blocks first (FIFO), and only then evicts cached free blocks,
least recently freed first (LRU). Block 0 is the null block: never handed out, never freed; the
device writes padding tokens into it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping

NULL_BLOCK = 0


class BlockPool:
    """Blocks 1..num_blocks-1 of `block_size` KV slots each; block 0 is the null block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need >= 2 (block 0 is the null block)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(1, num_blocks))     # uncached, reuse FIFO
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, least recent first

    # ---- counts ---------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Free blocks without a hash."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a hashed prefix (evictable)."""
        return len(self._evictable)

    @property
    def num_allocatable_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_allocatable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hashes[block_id]

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the prefix hashed `block_hash`, in use or cached free."""
        return self._hash_to_block.get(block_hash)

    def lookup_chain(self, block_hashes: Iterable[bytes]) -> list[int]:
        """The blocks holding a chain of hashed blocks, up to the first that is not cached."""
        blocks = []
        for h in block_hashes:
            if h not in self._hash_to_block:
                break
            blocks.append(self._hash_to_block[h])
        return blocks

    def eviction_order(self) -> tuple[int, ...]:
        """Cached free blocks, the next one `allocate` would evict first."""
        return tuple(self._evictable)

    def free_order(self) -> tuple[int, ...]:
        """Uncached free blocks, the next one `allocate` would hand out first."""
        return tuple(self._free)

    # ---- transitions ----------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """`n` blocks with ref count 1 and no hash; uncached free blocks first, then LRU."""
        if n < 0 or n > self.num_allocatable_blocks:
            raise ValueError(f"cannot allocate {n} blocks: {self.num_free_blocks} free + "
                             f"{self.num_cached_free_blocks} cached free")
        blocks: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                evicted = self._hashes[block]
                assert evicted is not None and self._hash_to_block[evicted] == block
                del self._hash_to_block[evicted]
                self._hashes[block] = None
            assert self._ref_counts[block] == 0
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _check_id(self, block_id: int) -> None:
        if not 1 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range 1..{self.num_blocks - 1}")

    def share(self, block_id: int) -> None:
        """One more reference to a hashed block found by a prefix hit (revives it if free)."""
        self._check_id(block_id)
        if self._hashes[block_id] is None:
            raise ValueError(f"block {block_id} has no hash: only cached blocks are shared")
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order; the first freed is evicted first."""
        for block in block_ids:
            self._check_id(block)
            if self._ref_counts[block] <= 0:
                raise ValueError(f"block {block} is not in use (ref={self._ref_counts[block]})")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._hashes[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def forget_hashes(self) -> None:
        """Drop every block hash (the device cache contents were lost): cached free blocks
        become plain free blocks and no later request can hit them."""
        self._hashes = [None] * self.num_blocks
        self._hash_to_block.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Register an in-use full block under `block_hash`; False when another block already
        holds that prefix (the newer copy stays unhashed and is freed as garbage)."""
        self._check_id(block_id)
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use: only in-use blocks get a hash")
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} already has a different hash")
            return True
        if block_hash in self._hash_to_block:
            return False
        self._hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def adopt(self, block_hash: bytes) -> int | None:
        """A block for contents computed elsewhere (another worker's prefix, handed over):
        allocated, registered under `block_hash` and freed at once, so that it sits cached
        free like any finished request's block, the most recently freed (evicted last).  The
        caller writes its KV before the next step.  None when the prefix is here already or
        no block is allocatable."""
        if block_hash in self._hash_to_block or not self.num_allocatable_blocks:
            return None
        (block,) = self.allocate(1)
        self._hashes[block] = block_hash
        self._hash_to_block[block_hash] = block
        self.free([block])
        return block

    # ---- invariants -----------------------------------------------------------------------

    def check_integrity(self, expected_refs: Mapping[int, int] | None = None) -> None:
        """Assert the pool's invariants; with `expected_refs` (block -> number of tables
        holding it), also that every ref count equals it."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & evictable, f"blocks both free and cached free: {free & evictable}"
        assert (free | evictable) <= set(range(1, self.num_blocks)), (
            f"free lists hold ids outside 1..{self.num_blocks - 1}: "
            f"{sorted((free | evictable) - set(range(1, self.num_blocks)))}")
        assert self._ref_counts[NULL_BLOCK] == 0, "null block has references"
        assert self._hashes[NULL_BLOCK] is None, "null block has a hash"
        in_use = {b for b in range(1, self.num_blocks) if self._ref_counts[b] > 0}
        assert all(c >= 0 for c in self._ref_counts), "negative ref count"
        assert len(free) + len(evictable) + len(in_use) == self.num_usable_blocks, (
            f"free {len(free)} + cached {len(evictable)} + in use {len(in_use)} "
            f"!= {self.num_usable_blocks}")
        assert not in_use & (free | evictable), "in-use block in a free list"
        for b in free:
            assert self._hashes[b] is None, f"uncached free block {b} has a hash"
        for b in evictable:
            assert self._hashes[b] is not None, f"cached free block {b} has no hash"
        hashed = {b for b in range(self.num_blocks) if self._hashes[b] is not None}
        assert len(self._hash_to_block) == len(hashed), "hash map and block hashes disagree"
        for h, b in self._hash_to_block.items():
            assert self._hashes[b] == h, f"hash map sends a hash to block {b}, which has another"
        if expected_refs is not None:
            for b in range(1, self.num_blocks):
                assert self._ref_counts[b] == expected_refs.get(b, 0), (
                    f"block {b}: ref {self._ref_counts[b]} != held by "
                    f"{expected_refs.get(b, 0)} tables")
