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

The export may also run while the prefill request is still running, between its steps, for
the blocks registered so far (`first_block` on: the ones not yet sent), and the import takes
such a slice once the blocks before it are cached here: a long prompt's transfer then
overlaps its later prefill chunks (disagg/transfer.py follows the request).

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
    """The KV of a prompt's full blocks [first_block, first_block + num_blocks)."""

    block_size: int
    k: np.ndarray   # [L, n, bs, K, D'] in the cache's dtype (D' = D + 4 for an int8 cache)
    v: np.ndarray   # the same
    first_block: int = 0

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


def cached_blocks(engine, token_ids: Sequence[int], tenant: str) -> list[int]:
    """The physical blocks this engine holds for the leading full blocks of `token_ids` under
    `tenant`'s salt, up to the first that is not cached (in use or cached free)."""
    hashes = prefix_block_hashes(token_ids, engine.scheduler.config.block_size, tenant)
    return engine.scheduler.kv_cache.pool.lookup_chain(hashes)


def export_prefix(engine, token_ids: Sequence[int], tenant: str, first_block: int = 0
                  ) -> PrefixKV:
    """The KV this engine holds for the leading full blocks of `token_ids` from
    `first_block` on, as far as they are all still cached (possibly none).  A running
    request's registered blocks are final: their KV was written by a step already launched,
    which the gather waits for."""
    if first_block < 0:
        raise ValueError(f"first_block {first_block} < 0")
    blocks = cached_blocks(engine, token_ids, tenant)[first_block:]
    k, v = gather_blocks(engine.runner.kv, blocks)
    return PrefixKV(engine.scheduler.config.block_size, k, v, first_block)


def import_prefix(engine, token_ids: Sequence[int], tenant: str, kv: PrefixKV) -> int:
    """Adopt `kv` (another engine's export for the same `token_ids` and `tenant`) into this
    engine's prefix cache; returns the number of blocks whose KV was written (blocks already
    cached here are kept; a pool without room takes fewer; none when a block before
    `kv.first_block` is not cached here, as the later ones could never be hit)."""
    sched = engine.scheduler
    bs = sched.config.block_size
    if kv.block_size != bs:
        raise ValueError(f"block_size {kv.block_size} of the handed-over KV differs from this "
                         f"engine's {bs}")
    end = kv.first_block + kv.num_blocks
    if end * bs > len(token_ids) or kv.first_block < 0:
        raise ValueError(f"blocks [{kv.first_block}, {end}) of {bs} tokens for a prompt of "
                         f"{len(token_ids)} tokens")
    if not sched.kv_cache.enable_prefix_caching:
        return 0
    pool = sched.kv_cache.pool
    # Each adopt allocates one block and frees it to the most-recent end: past this many it
    # would evict a block adopted here.
    room = pool.num_allocatable_blocks
    ids, src = [], []
    for i, h in enumerate(prefix_block_hashes(token_ids[:end * bs], bs, tenant)):
        if pool.lookup(h) is not None:
            continue
        block = pool.adopt(h) if len(ids) < room and i >= kv.first_block else None
        if block is None:
            break     # later blocks could never be hit without this one
        ids.append(block)
        src.append(i - kv.first_block)
    if ids:
        engine.runner.kv = scatter_blocks(engine.runner.kv, ids, kv.k[:, src], kv.v[:, src])
    return len(ids)
