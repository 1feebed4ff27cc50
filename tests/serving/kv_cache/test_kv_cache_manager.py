"""KVCacheManager: block tables, prefix hits, sharing, eviction order, usage and stats."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from xlaserve.serving.kv_cache import CachedPrefix, KVCacheManager, KVCacheUsage

BS = 4


@pytest.fixture
def kv() -> Iterator[KVCacheManager]:
    m = KVCacheManager(num_blocks=9, block_size=BS)   # usable blocks 1..8
    yield m
    m.check_integrity()


def admit(kv: KVCacheManager, rid: str, tokens: list[int], salt: str = "") -> CachedPrefix:
    """Allocate the whole prompt after its prefix hit and register its full blocks."""
    prefix = kv.find_cached_prefix(tokens, salt)
    assert kv.allocate_slots(rid, len(tokens) - prefix.num_tokens, prefix)
    kv.cache_blocks(rid, tokens, len(tokens))
    return prefix


def test_table_grows_append_only_and_waste(kv: KVCacheManager) -> None:
    assert kv.allocate_slots("a", 5, CachedPrefix(""))
    assert kv.block_table("a") == (1, 2)
    assert kv.usage() == KVCacheUsage(8, 2, 0, 6, waste=3 / 8)
    assert kv.allocate_slots("a", 3)                 # fills block 2 exactly
    assert kv.block_table("a") == (1, 2)
    assert kv.allocate_slots("a", 1)
    assert kv.block_table("a") == (1, 2, 3) and kv.num_tokens("a") == 9
    assert kv.usage().waste == 3 / 12
    kv.check_integrity()
    kv.free("a")
    assert kv.usage() == KVCacheUsage(8, 0, 0, 8, 0.0)


def test_allocation_failure_has_no_side_effects(kv: KVCacheManager) -> None:
    assert kv.allocate_slots("a", 30, CachedPrefix(""))         # 8 blocks: all of them
    assert not kv.allocate_slots("a", 3)                          # needs a ninth
    assert kv.num_tokens("a") == 30 and kv.block_table("a") == tuple(range(1, 9))
    assert not kv.allocate_slots("b", 1, CachedPrefix(""))
    assert "b" not in kv
    assert kv.prefix_cache_stats.num_queries == 1
    kv.free("a")


def test_prefix_hit_shares_blocks_and_never_covers_last_token(kv: KVCacheManager) -> None:
    prompt = list(range(10))                                      # blocks [0..3] [4..7] [8 9]
    assert admit(kv, "a", prompt).num_tokens == 0
    assert kv.block_table("a") == (1, 2, 3)
    hit = admit(kv, "b", prompt)
    assert (hit.block_ids, hit.num_tokens) == ((1, 2), 8)
    assert kv.block_table("b") == (1, 2, 4)
    assert [kv.pool.ref_count(b) for b in (1, 2, 3, 4)] == [2, 2, 1, 1]
    kv.check_integrity()
    # An 8-token prompt is exactly two full blocks, but its last token must be computed.
    assert kv.find_cached_prefix(prompt[:8], "").block_ids == (1,)
    assert kv.find_cached_prefix(prompt[:9], "").block_ids == (1, 2)
    # A different second block stops the chain at the first miss.
    assert kv.find_cached_prefix([0, 1, 2, 3, 9, 9, 9, 9, 9], "").block_ids == (1,)
    stats = kv.prefix_cache_stats
    assert (stats.num_queries, stats.queried_tokens, stats.hit_tokens) == (2, 20, 8)
    assert stats.hit_rate == 8 / 20
    kv.free("a")
    kv.free("b")


def test_tenant_salt_prevents_sharing(kv: KVCacheManager) -> None:
    prompt = list(range(9))
    admit(kv, "a", prompt, salt="acme")
    assert kv.find_cached_prefix(prompt, "globex").block_ids == ()
    assert kv.find_cached_prefix(prompt, "").block_ids == ()
    assert kv.find_cached_prefix(prompt, "acme").block_ids == (1, 2)
    admit(kv, "b", prompt, salt="globex")
    assert kv.block_table("b") == (4, 5, 6)
    kv.free("a")
    kv.free("b")


def test_freed_prefix_stays_cached_tail_evicted_first(kv: KVCacheManager) -> None:
    prompt = list(range(100, 113))                                # 3 full blocks + 1 token
    admit(kv, "a", prompt)
    assert kv.block_table("a") == (1, 2, 3, 4)
    kv.free("a")
    # Freed last block first: 4 has no hash (partial) -> free list; 3, 2, 1 cached, LRU 3 first.
    assert kv.pool.eviction_order() == (3, 2, 1)
    assert kv.pool.free_order() == (5, 6, 7, 8, 4)
    assert kv.usage() == KVCacheUsage(8, 0, 3, 5, 0.0)
    # A hit revives the cached blocks; a fresh request takes uncached blocks first.
    hit = admit(kv, "b", prompt)
    assert hit.block_ids == (1, 2, 3) and kv.block_table("b") == (1, 2, 3, 5)
    kv.free("b")
    assert kv.pool.eviction_order() == (3, 2, 1)
    assert kv.allocate_slots("c", 20, CachedPrefix(""))           # 5 blocks: 6 7 8 4 5
    assert kv.block_table("c") == (6, 7, 8, 4, 5)
    assert kv.allocate_slots("c", 4)                              # evicts 3 (LRU), not 1
    assert kv.block_table("c")[-1] == 3
    assert kv.find_cached_prefix(prompt, "").block_ids == (1, 2)
    kv.check_integrity()
    assert kv.allocate_slots("c", 8)                              # evicts 2 then 1
    assert kv.block_table("c")[-2:] == (2, 1)
    assert kv.find_cached_prefix(prompt, "").block_ids == ()
    kv.free("c")


def test_hit_on_cached_free_blocks_counts_against_allocatable() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)              # usable 1..3
    prompt = list(range(9))
    admit(kv, "a", prompt)
    kv.free("a")                                                  # cached 2, 1; free 3
    prefix = kv.find_cached_prefix(prompt + [5, 5, 5, 5], "")     # hits 1, 2
    assert prefix.block_ids == (1, 2)
    # 13 tokens = 4 blocks: 2 hit + 2 new, but only block 3 is left once 1 and 2 are revived.
    assert not kv.allocate_slots("b", 5, prefix)
    assert kv.pool.eviction_order() == (2, 1) and "b" not in kv
    assert kv.allocate_slots("b", 4, prefix)
    assert kv.block_table("b") == (1, 2, 3)
    kv.free("b")
    kv.check_integrity()


def test_shared_system_prompt_held_once() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=16)
    system = [7] * 512                                            # 32 full blocks
    for i in range(16):
        admit(kv, f"r{i}", system + [1000 + i] * 8)
    assert kv.usage().num_used_blocks == 32 + 16                  # 32 shared + 1 tail each
    assert all(kv.pool.ref_count(b) == 16 for b in kv.block_table("r0")[:32])
    assert kv.block_table("r5")[:32] == kv.block_table("r0")[:32]
    stats = kv.prefix_cache_stats
    assert (stats.queried_tokens, stats.hit_tokens) == (16 * 520, 15 * 512)
    kv.check_integrity()
    for i in range(16):
        kv.free(f"r{i}")
    assert kv.usage() == KVCacheUsage(63, 0, 32, 31, 0.0)
    kv.check_integrity()


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    admit(kv, "a", prompt)
    assert admit(kv, "b", prompt).block_ids == ()
    assert kv.block_table("b") == (4, 5, 6)
    kv.free("a")
    kv.free("b")
    assert kv.pool.num_cached_free_blocks == 0
    kv.check_integrity()


def test_boundary_errors(kv: KVCacheManager) -> None:
    with pytest.raises(ValueError, match="is new: pass its cached prefix"):
        kv.allocate_slots("x", 1)
    kv.allocate_slots("x", 2, CachedPrefix(""))
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate_slots("x", 1, CachedPrefix(""))
    with pytest.raises(ValueError, match="cannot cache 5 tokens, 2 reserved"):
        kv.cache_blocks("x", list(range(8)), 5)
    with pytest.raises(ValueError, match="unknown request 'y'"):
        kv.block_table("y")
    kv.free("x")


def test_stale_prefix_is_refused_without_changes(kv: KVCacheManager) -> None:
    admit(kv, "a", list(range(9)))                    # blocks 1, 2 hashed, 3 holds token 8
    kv.free("a")
    prefix = kv.find_cached_prefix(list(range(9)), "")
    assert prefix.block_ids == (1, 2) and prefix.miss_hash is None
    admit(kv, "b", [50] * 28)         # 7 blocks: the 6 uncached free ones, then evicts 2
    assert kv.pool.hash_of(2) != prefix.block_hashes[1]
    before = (kv.usage(), kv.pool.ref_count(1), kv.pool.eviction_order())
    with pytest.raises(ValueError, match=r"'c': the cached prefix is stale \(blocks \[2\]"):
        kv.allocate_slots("c", 1, prefix)
    assert "c" not in kv
    assert (kv.usage(), kv.pool.ref_count(1), kv.pool.eviction_order()) == before
    kv.free("b")


def test_miss_hash_and_unregistered_hashes(kv: KVCacheManager) -> None:
    tokens = list(range(13))                          # 3 full blocks; a hit may cover all 3
    hashes = kv.find_cached_prefix(tokens, "").block_hashes
    assert hashes == ()
    assert kv.allocate_slots("a", 13, CachedPrefix(""))
    pending = kv.unregistered_block_hashes("a", tokens)
    assert len(pending) == 3
    assert kv.find_cached_prefix(tokens, "").miss_hash == pending[0]
    kv.cache_blocks("a", tokens, 8)                   # blocks 0 and 1 registered
    assert kv.unregistered_block_hashes("a", tokens) == pending[2:]
    assert kv.find_cached_prefix(tokens, "").miss_hash == pending[2]
    kv.cache_blocks("a", tokens, 12)
    assert kv.find_cached_prefix(tokens, "").miss_hash is None
    assert kv.find_cached_prefix(tokens, "other tenant").miss_hash not in pending
    kv.free("a")


def test_unknown_request_errors_name_it(kv: KVCacheManager) -> None:
    for call in (lambda: kv.free("ghost"), lambda: kv.block_table("ghost"),
                 lambda: kv.unregistered_block_hashes("ghost", [1])):
        with pytest.raises(ValueError, match="unknown request 'ghost' in the KV cache"):
            call()
