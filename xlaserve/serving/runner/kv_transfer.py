"""Whole KV blocks between the device cache and the host, for handing a prompt's KV from one
worker to another (serving/engine/kv_handoff.py).

    gather_blocks(kv, ids)            -> k, v   [L, n, bs, K, D'] numpy, the cache's dtype
    scatter_blocks(kv, ids, k, v)     -> kv with blocks `ids` overwritten (kv donated)

Block counts are padded to a power of two (padding reads / writes the null block 0, whose
contents are garbage by design), so a handoff of n blocks compiles one program per
ceil(log2 n) bucket, not per n.  Works on any single-process layout: the jitted gather and
scatter keep the cache's sharding (kv heads over `tensor`, layers over `pipeline`).  A cache
spread over several processes is refused (ValueError): this process holds only its shard
(the split's workers are refused such a layout at start-up: disagg/workers.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from xlaserve.models.llama import KVCache
from xlaserve.serving.kv_cache.block_pool import NULL_BLOCK


def padded_count(n: int) -> int:
    """The bucket a transfer of `n` blocks runs in: the next power of two (at least 1)."""
    return 1 << max(n - 1, 0).bit_length()


def _padded_ids(block_ids: Sequence[int]) -> np.ndarray:
    ids = np.full(padded_count(len(block_ids)), NULL_BLOCK, np.int32)
    ids[:len(block_ids)] = block_ids
    return ids


_gather = jax.jit(lambda k, v, ids: (k[:, ids], v[:, ids]))
_scatter = jax.jit(lambda k, v, ids, nk, nv: (k.at[:, ids].set(nk), v.at[:, ids].set(nv)),
                   donate_argnums=(0, 1))


def _check_addressable(kv: KVCache) -> None:
    if not kv.k.is_fully_addressable:
        raise ValueError(f"the KV cache spans {len({d.process_index for d in kv.k.devices()})} "
                         "processes: a process holds only its shard, so its blocks cannot be "
                         "handed to another worker")


def gather_blocks(kv: KVCache, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The K and V of `block_ids`, in order: two [L, n, bs, K, D'] host arrays."""
    _check_addressable(kv)
    n = len(block_ids)
    if n == 0:   # no device work: a follow's poll must not wait for the step in flight
        empty = np.zeros((kv.k.shape[0], 0, *kv.k.shape[2:]), kv.k.dtype)
        return empty, empty.copy()
    k, v = _gather(kv.k, kv.v, _padded_ids(block_ids))
    return np.asarray(k)[:, :n], np.asarray(v)[:, :n]


def scatter_blocks(kv: KVCache, block_ids: Sequence[int], k: np.ndarray,
                   v: np.ndarray) -> KVCache:
    """`kv` with blocks `block_ids` holding `k` and `v` ([L, n, bs, K, D'], n = len(ids),
    the cache's dtype); the ids must be distinct (one write per block).  `kv` is donated: use
    the returned cache."""
    _check_addressable(kv)
    n = len(block_ids)
    want = (kv.k.shape[0], n, *kv.k.shape[2:])
    for name, a in (("k", k), ("v", v)):
        if a.shape != want or a.dtype != kv.k.dtype:
            raise ValueError(f"{name} has shape {a.shape} and dtype {a.dtype}; blocks for this "
                             f"cache are {want} {kv.k.dtype}")
    if len(set(block_ids)) != n or NULL_BLOCK in block_ids:
        raise ValueError(f"block ids must be distinct and not the null block: {list(block_ids)}")
    ids = _padded_ids(block_ids)
    pad = [(0, 0), (0, len(ids) - n)] + [(0, 0)] * (k.ndim - 2)
    nk, nv = _scatter(kv.k, kv.v, ids, np.pad(k, pad), np.pad(v, pad))
    return KVCache(nk, nv)
