"""BlockPool: exact block ids, free-list order and LRU eviction order."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from xlaserve.serving.kv_cache import NULL_BLOCK, BlockPool, block_hash


def h(i: int) -> bytes:
    return block_hash(None, [i], "")


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    p = BlockPool(num_blocks=6, block_size=4)   # usable blocks 1..5
    yield p
    p.check_integrity()


def test_null_block_never_handed_out(pool: BlockPool) -> None:
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    assert NULL_BLOCK not in pool.free_order()
    with pytest.raises(ValueError, match="cannot allocate 1 blocks: 0 free \\+ 0 cached free"):
        pool.allocate(1)
    for bad in (NULL_BLOCK, -1, 6):  # -1 would index the last block
        with pytest.raises(ValueError, match=f"block id {bad} is out of range 1..5"):
            pool.free([bad])
        with pytest.raises(ValueError, match=f"block id {bad} is out of range 1..5"):
            pool.share(bad)
    pool.free([1, 2, 3, 4, 5])


def test_uncached_blocks_reused_fifo_before_fresh_run_out(pool: BlockPool) -> None:
    assert pool.allocate(2) == [1, 2]
    pool.free([2])
    pool.free([1])
    assert pool.free_order() == (3, 4, 5, 2, 1)
    assert pool.allocate(4) == [3, 4, 5, 2]
    pool.free([3, 4, 5, 2])


def test_uncached_reused_first_then_least_recently_freed_cached(pool: BlockPool) -> None:
    blocks = pool.allocate(5)
    for b in (1, 2, 3):
        assert pool.cache(b, h(b))
    pool.free([3])
    pool.free([1, 4, 2])
    assert pool.eviction_order() == (3, 1, 2)
    assert pool.free_order() == (4,)
    assert (pool.num_free_blocks, pool.num_cached_free_blocks, pool.num_used_blocks) == (1, 3, 1)
    assert pool.allocate(1) == [4]          # the uncached block first
    assert pool.allocate(2) == [3, 1]       # then evict LRU: 3 was freed before 1
    assert pool.lookup(h(3)) is None and pool.lookup(h(1)) is None
    assert pool.hash_of(3) is None
    assert pool.lookup(h(2)) == 2
    pool.free([4, 3, 1, 5])
    assert blocks == [1, 2, 3, 4, 5]


def test_share_revives_cached_free_block(pool: BlockPool) -> None:
    pool.allocate(2)
    pool.cache(1, h(1))
    pool.free([1, 2])
    assert pool.eviction_order() == (1,)
    pool.share(1)
    pool.share(1)
    assert pool.ref_count(1) == 2 and pool.eviction_order() == ()
    pool.free([1])
    assert pool.eviction_order() == ()
    pool.free([1])
    assert pool.eviction_order() == (1,)
    with pytest.raises(ValueError, match="block 2 has no hash"):
        pool.share(2)


def test_duplicate_content_stays_unhashed(pool: BlockPool) -> None:
    pool.allocate(2)
    assert pool.cache(1, h(7))
    assert pool.cache(1, h(7))              # idempotent
    assert not pool.cache(2, h(7))          # block 1 already holds that prefix
    assert pool.hash_of(2) is None and pool.lookup(h(7)) == 1
    pool.free([2, 1])
    assert pool.free_order()[-1] == 2 and pool.eviction_order() == (1,)


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(1, 16)
    with pytest.raises(ValueError, match="block_size=0"):
        BlockPool(4, 0)
