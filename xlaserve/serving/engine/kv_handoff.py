"""A prompt's KV handed from one engine to another: the prefill/decode split's transfer.

    prefill engine                                   decode engine
    add(request, max_tokens=1) ... finished          (the first token went to the client)
    export_prefix(engine, prompt, tenant) ──────────> import_prefix(engine, prompt, tenant, kv)
      the prompt's full blocks, found by their          each block adopted into the prefix
      chained hashes in the prefix cache                cache (cached free, hashed) and its
      (in use or cached free)                           KV written on device
                                                     add(request, output_token_ids=(first,))
                                                       a prefix hit on every adopted block:
                                                       only the prompt's last partial block
                                                       and the first token are computed

No block is ever pinned for the handoff: the prefill side's blocks are its prefix cache's (an
eviction before the export just shortens what is sent), the decode side's are cached free
until the request's hit takes them.  A lost or partial transfer costs recomputation, never
a wrong token: a block is only ever found under the hash of the tokens it holds.  Engine-thread
only (the caller is the engine's own thread: ThreadedEngine.call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xlaserve.serving.kv_cache.block_hash import prefix_block_hashes
from xlaserve.serving.runner.kv_transfer import gather_blocks, scatter_blocks


@dataclass(frozen=True)
class PrefixKV:
    """The KV of the first `num_blocks` full blocks of a prompt."""

    block_size: int
    k: np.ndarray   # [L, n, bs, K, D'] in the cache's dtype (D' = D + 4 for an int8 cache)
    v: np.ndarray   # the same

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


def export_prefix(engine, token_ids: Sequence[int], tenant: str) -> PrefixKV:
    """The KV this engine holds for the leading full blocks of `token_ids` under `tenant`'s
    salt, as far as they are all still cached (possibly none)."""
    pool = engine.scheduler.kv_cache.pool
    bs = engine.scheduler.config.block_size
    blocks = []
    for h in prefix_block_hashes(token_ids, bs, tenant):
        block = pool.lookup(h)
        if block is None:
            break
        blocks.append(block)
    k, v = gather_blocks(engine.runner.kv, blocks)
    return PrefixKV(bs, k, v)


def import_prefix(engine, token_ids: Sequence[int], tenant: str, kv: PrefixKV) -> int:
    """Adopt `kv` (another engine's export for the same `token_ids` and `tenant`) into this
    engine's prefix cache; returns the number of blocks whose KV was written (blocks already
    cached here are kept; a pool without room takes fewer)."""
    sched = engine.scheduler
    bs = sched.config.block_size
    if kv.block_size != bs:
        raise ValueError(f"block_size {kv.block_size} of the handed-over KV differs from this "
                         f"engine's {bs}")
    if kv.num_blocks * bs > len(token_ids):
        raise ValueError(f"{kv.num_blocks} blocks of {bs} tokens for a prompt of "
                         f"{len(token_ids)} tokens")
    if not sched.kv_cache.enable_prefix_caching:
        return 0
    pool = sched.kv_cache.pool
    # Each adopt allocates one block and frees it to the most-recent end: past this many it
    # would evict a block adopted here.
    room = pool.num_allocatable_blocks
    ids, src = [], []
    for i, h in enumerate(prefix_block_hashes(token_ids[:kv.num_blocks * bs], bs, tenant)):
        if pool.lookup(h) is not None:
            continue
        block = pool.adopt(h) if len(ids) < room else None
        if block is None:
            break     # later blocks could never be hit without this one
        ids.append(block)
        src.append(i)
    if ids:
        engine.runner.kv = scatter_blocks(engine.runner.kv, ids, kv.k[:, src], kv.v[:, src])
    return len(ids)
