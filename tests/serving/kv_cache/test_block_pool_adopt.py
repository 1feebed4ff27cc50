"""BlockPool.adopt: a block for KV computed elsewhere enters as cached free (hashed, evicted
last), is hit like any other, and never displaces a prefix already here."""

from __future__ import annotations

from xlaserve.serving.kv_cache.block_pool import BlockPool


def test_adopted_block_is_cached_free_and_most_recent():
    pool = BlockPool(5, 4)
    (old,) = pool.allocate(1)
    pool.cache(old, b"old")
    pool.free([old])
    block = pool.adopt(b"new")
    assert block is not None and block != old
    assert pool.lookup(b"new") == block and pool.ref_count(block) == 0
    assert pool.eviction_order() == (old, block)      # adopted last: evicted last
    pool.share(block)                                 # a prefix hit takes it
    assert pool.ref_count(block) == 1
    pool.free([block])
    pool.check_integrity()


def test_adopt_keeps_what_is_here_and_stops_when_full():
    pool = BlockPool(3, 4)
    first = pool.adopt(b"a")
    assert pool.adopt(b"a") is None and pool.lookup(b"a") == first   # already here
    held = pool.allocate(2)                    # every usable block in use (one evicted: a)
    assert pool.lookup(b"a") is None
    assert pool.adopt(b"b") is None            # nothing allocatable
    pool.free(held)
    pool.check_integrity()
