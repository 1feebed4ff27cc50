"""Ragged paged attention for a chunk of query tokens per sequence (chunked prefill, prefix hits).

Row b holds `q_lens[b]` query tokens: the newest tokens of a sequence whose KV (already written
to the cache, this chunk included) is `kv_lens[b]` long.  Query token t sits at absolute position
`kv_lens[b] - q_lens[b] + t` and attends causally to every cached token at or before it, read
through the row's block table.  Query slots t >= q_lens[b] are padding and come out as zeros.

The cache keeps every layer: `[layers, blocks, block_size, kv_heads, head_dim]`, and `layer` picks
one, so that a kernel reads the stacked cache in place instead of a copied slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30


def gather_kv(cache: jax.Array, layer: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Rows of one layer's cache through block tables.

    cache: [L, N, bs, KVH, D]; block_tables: [B, W] -> [B, W * bs, KVH, D]."""
    _, num_blocks, block_size, kvh, d = cache.shape
    flat = cache.reshape(-1, kvh, d)                                   # [L*N*bs, KVH, D]
    base = (layer * num_blocks + block_tables) * block_size            # [B, W]
    idx = base[:, :, None] + jnp.arange(block_size, dtype=base.dtype)  # [B, W, bs]
    b, w = block_tables.shape
    return flat[idx.reshape(b, w * block_size)]


def prefill_attention_reference(
    q: jax.Array,             # [B, T, H, D]
    k_cache: jax.Array,       # [L, N, bs, KVH, D]
    v_cache: jax.Array,       # [L, N, bs, KVH, D]
    layer: jax.Array,         # [] int32
    block_tables: jax.Array,  # [B, W] int32
    q_lens: jax.Array,        # [B] int32
    kv_lens: jax.Array,       # [B] int32
    *,
    scale: float,
    soft_cap: float | None = None,
) -> jax.Array:               # [B, T, H, D]
    b, t, h, d = q.shape
    kvh = k_cache.shape[3]
    g = h // kvh
    k = gather_kv(k_cache, layer, block_tables).astype(jnp.float32)  # [B, S, KVH, D]
    v = gather_kv(v_cache, layer, block_tables).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(b, t, kvh, g, d)
    # B batch, T query, K kv head, G group, D head dim, S key position.
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) * scale            # [B, KVH, G, T, S]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    s = k.shape[1]
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(t)[None, :]       # [B, T]
    key_pos = jnp.arange(s)                                            # [S]
    valid = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
        key_pos[None, None, :] < kv_lens[:, None, None])               # [B, T, S]
    scores = jnp.where(valid[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)
    q_valid = jnp.arange(t)[None, :] < q_lens[:, None]                 # [B, T]
    return jnp.where(q_valid[:, :, None, None], out, 0.0).astype(q.dtype)
