"""Per-request block tables over one BlockPool, with prefix sharing by block hash.

A request's life in the cache (the scheduler drives it; all ids are physical block ids):

    find_cached_prefix(tokens, salt)   hashes the prompt's full blocks, stops at the first miss;
                                       no side effects (the scheduler may not admit the request)
                                       and only valid until the cache next changes
    allocate_slots(id, n, prefix)      first call: the table starts with the hit blocks (shared,
                                       ref += 1), then grows by fresh blocks to hold n more
                                       tokens; later calls: n more tokens. All or nothing: False
                                       and no change when the pool is short.
    cache_blocks(id, tokens, k)        the first k tokens are (being) computed: register every
                                       newly full block among them under its chained hash
    trim(id, n)                        keep slots for the first n tokens only (speculative
                                       decoding gives back rejected drafts' slots): blocks past
                                       them, never hashed, go back to the free list
    free(id)                           ref -= 1 on every block, last block first, so a request's
                                       tail is evicted before its prefix

    table:   [ 7 | 3 | 12 | 5 ]        append-only; a hit never covers the last prompt token,
    hashes:  [h0 | h1 |  - | - ]        so at least one token is always computed (and sampled)
    tokens:  |<------ num_tokens ------>....|   waste = reserved-but-unwritten slots

A block becomes hittable once `cache_blocks` registers it; the scheduler registers blocks only
between steps, so a hit always reads KV written by an earlier device step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from xlaserve.serving.kv_cache.block_hash import block_hash, prefix_block_hashes
from xlaserve.serving.kv_cache.block_pool import BlockPool


@dataclass(frozen=True)
class CachedPrefix:
    """The result of a prefix-cache lookup for one prompt under one salt."""

    salt: str
    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[bytes, ...] = ()
    num_tokens: int = 0          # tokens covered by block_ids (full blocks only)
    num_queried_tokens: int = 0  # prompt length looked up
    miss_hash: bytes | None = None  # the first hittable block that missed (None: no such block)


@dataclass(frozen=True)
class KVCacheUsage:
    num_total_blocks: int        # usable blocks (the null block excluded)
    num_used_blocks: int         # ref > 0
    num_cached_free_blocks: int  # ref == 0 with a hash: reusable by a hit, evictable
    num_free_blocks: int         # ref == 0 without a hash
    waste: float                 # reserved-but-unwritten slots / slots of used blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks


@dataclass(frozen=True)
class PrefixCacheStats:
    num_queries: int = 0      # requests admitted with a lookup (first admissions only)
    queried_tokens: int = 0
    hit_tokens: int = 0
    readmitted_hit_tokens: int = 0   # preempted requests finding their own blocks again

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class _RequestBlocks:
    salt: str
    table: list[int]
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of table[:len(hashes)]
    num_tokens: int = 0                                 # slots reserved for tokens


class KVCacheManager:
    """Block tables keyed by request id; see the module docstring for the protocol."""

    def __init__(self, num_blocks: int, block_size: int, *,
                 enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._requests: dict[str, _RequestBlocks] = {}
        self._stats = PrefixCacheStats()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> frozenset[str]:
        return frozenset(self._requests)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def room(self, request_id: str) -> int:
        """How many more tokens `request_id` could get now: the free slots of its last block
        and every block the pool can allocate."""
        state = self._get(request_id)
        spare = len(state.table) * self.block_size - state.num_tokens
        return spare + self.pool.num_allocatable_blocks * self.block_size

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._get(request_id).table)

    def num_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_tokens

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats

    def find_cached_prefix(self, token_ids: Sequence[int], salt: str) -> CachedPrefix:
        """The longest run of cached full blocks at the start of `token_ids`, leaving at least
        the last token to compute: at most floor((len - 1) / block_size) blocks."""
        if not self.enable_prefix_caching or not token_ids:
            return CachedPrefix(salt, num_queried_tokens=len(token_ids))
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = prefix_block_hashes(token_ids[:max_blocks * self.block_size],
                                     self.block_size, salt)
        blocks = self.pool.lookup_chain(hashes)
        miss = hashes[len(blocks)] if len(blocks) < len(hashes) else None
        return CachedPrefix(salt, tuple(blocks), tuple(hashes[:len(blocks)]),
                            len(blocks) * self.block_size, len(token_ids), miss)

    def unregistered_block_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[bytes]:
        """The chained hashes of the full blocks of `token_ids` (the request's tokens from
        position 0) that the request has not registered yet: blocks it will compute and then
        offer to the prefix cache."""
        state = self._get(request_id)
        return self._next_hashes(state, token_ids) if self.enable_prefix_caching else []

    def _next_hashes(self, state: _RequestBlocks, token_ids: Sequence[int]) -> list[bytes]:
        """Chained hashes of the full blocks of `token_ids` past the `state.hashes` ones."""
        bs = self.block_size
        parent = state.hashes[-1] if state.hashes else None
        out = []
        for i in range(len(state.hashes), len(token_ids) // bs):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs], state.salt)
            out.append(parent)
        return out

    def allocate_slots(self, request_id: str, num_new_tokens: int,
                       prefix: CachedPrefix | None = None, *, readmitted: bool = False) -> bool:
        """Reserve slots for `num_new_tokens` more tokens. A new request must pass its
        `prefix` (possibly empty) and starts from the hit blocks; `readmitted` (a preempted
        request coming back) keeps its hits out of the hit rate, which measures prompts served
        from other requests' blocks. False, with nothing changed, when the pool cannot supply
        the blocks."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens}: must be >= 0")
        state = self._requests.get(request_id)
        if state is None:
            if prefix is None:
                raise ValueError(f"request {request_id!r} is new: pass its cached prefix")
            have, hit_blocks = len(prefix.block_ids), prefix.block_ids
            stale = [b for b, h in zip(hit_blocks, prefix.block_hashes)
                     if self.pool.hash_of(b) != h]
            if stale:
                raise ValueError(f"request {request_id!r}: the cached prefix is stale (blocks "
                                 f"{stale} were evicted since the lookup); look it up again")
            num_tokens = prefix.num_tokens + num_new_tokens
            # Hit blocks sitting in the cached-free list stop being allocatable once shared.
            revived = sum(1 for b in hit_blocks if self.pool.ref_count(b) == 0)
        else:
            if prefix is not None:
                raise ValueError(f"request {request_id!r} already has blocks: no prefix")
            have, hit_blocks, revived = len(state.table), (), 0
            num_tokens = state.num_tokens + num_new_tokens
        need = max(0, self.blocks_needed(num_tokens) - have)
        if need > self.pool.num_allocatable_blocks - revived:
            return False
        if state is None:
            assert prefix is not None
            for b in hit_blocks:
                self.pool.share(b)
            state = _RequestBlocks(prefix.salt, list(hit_blocks), list(prefix.block_hashes))
            self._requests[request_id] = state
            s = self._stats
            if readmitted:
                self._stats = replace(
                    s, readmitted_hit_tokens=s.readmitted_hit_tokens + prefix.num_tokens)
            else:
                self._stats = PrefixCacheStats(s.num_queries + 1,
                                               s.queried_tokens + prefix.num_queried_tokens,
                                               s.hit_tokens + prefix.num_tokens,
                                               s.readmitted_hit_tokens)
        state.table.extend(self.pool.allocate(need))
        state.num_tokens = num_tokens
        return True

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Register the full blocks among the first `num_tokens` of `token_ids` (the request's
        tokens from position 0) that are not registered yet."""
        state = self._get(request_id)
        if num_tokens > min(state.num_tokens, len(token_ids)):
            raise ValueError(f"request {request_id!r}: cannot cache {num_tokens} tokens, "
                             f"{state.num_tokens} reserved, {len(token_ids)} given")
        if not self.enable_prefix_caching:
            return
        for h in self._next_hashes(state, token_ids[:num_tokens]):
            self.pool.cache(state.table[len(state.hashes)], h)  # False: a duplicate, unhashed
            state.hashes.append(h)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's reserved slots to its first `num_tokens` (rejected draft
        tokens' slots); blocks no longer needed are freed.  They hold no hash: only computed,
        known tokens are ever registered, and a trim never goes below those."""
        state = self._get(request_id)
        if not len(state.hashes) * self.block_size <= num_tokens <= state.num_tokens:
            raise ValueError(f"request {request_id!r}: cannot trim to {num_tokens} tokens "
                             f"({state.num_tokens} reserved, {len(state.hashes)} blocks hashed)")
        keep = self.blocks_needed(num_tokens)
        dropped = state.table[keep:]
        assert all(self.pool.hash_of(b) is None for b in dropped), (request_id, dropped)
        del state.table[keep:]
        state.num_tokens = num_tokens
        self.pool.free(reversed(dropped))

    def free(self, request_id: str) -> None:
        """Release every block of the request; hashed ones stay cached until evicted."""
        state = self._get(request_id)
        del self._requests[request_id]
        self.pool.free(reversed(state.table))

    def usage(self) -> KVCacheUsage:
        p = self.pool
        reserved = p.num_used_blocks * self.block_size
        unwritten = sum(len(s.table) * self.block_size - s.num_tokens
                        for s in self._requests.values())
        return KVCacheUsage(p.num_usable_blocks, p.num_used_blocks, p.num_cached_free_blocks,
                            p.num_free_blocks, unwritten / reserved if reserved else 0.0)

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for rid, s in self._requests.items():
            assert 0 not in s.table, f"request {rid!r} holds the null block"
            assert len(set(s.table)) == len(s.table), f"request {rid!r} holds a block twice"
            assert s.num_tokens <= len(s.table) * self.block_size, f"{rid!r}: slots overflow"
            assert len(s.table) == self.blocks_needed(s.num_tokens), f"{rid!r}: extra blocks"
            assert len(s.hashes) <= s.num_tokens // self.block_size, f"{rid!r}: hashed partial"
            for b in s.table:
                refs[b] = refs.get(b, 0) + 1
            for b, h in zip(s.table, s.hashes):
                own = self.pool.hash_of(b)
                assert own is None or own == h, f"{rid!r}: block {b} has another hash"
        self.pool.check_integrity(refs)

    def _get(self, request_id: str) -> _RequestBlocks:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(f"unknown request {request_id!r} in the KV cache") from None
