"""The host-side KV-cache bookkeeping: which physical blocks hold which request's tokens.

    scheduler --find_cached_prefix / allocate_slots / cache_blocks / free--> KVCacheManager
    KVCacheManager --block tables (lists of block ids)--> step plan --> runner (device arrays)
    KVCacheManager --allocate / share / free / cache--> BlockPool (ref counts, LRU, hash map)
    KVCacheManager --prefix_block_hashes--> the cached prefix of a new prompt (block_hash.py)

Plain Python, no jax: the runner owns the device KV arrays and only ever sees block ids.
"""

from xlaserve.serving.kv_cache.block_hash import block_hash, prefix_block_hashes
from xlaserve.serving.kv_cache.block_pool import NULL_BLOCK, BlockPool
from xlaserve.serving.kv_cache.kv_cache_manager import (
    CachedPrefix,
    KVCacheManager,
    KVCacheUsage,
    PrefixCacheStats,
)

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "CachedPrefix",
    "KVCacheManager",
    "KVCacheUsage",
    "PrefixCacheStats",
    "block_hash",
    "prefix_block_hashes",
]
