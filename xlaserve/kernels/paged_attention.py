"""Paged attention for decode: one query token per sequence over its cached KV blocks.

Row b's query is the newest token of a sequence whose KV (that token included) is `kv_lens[b]`
long; it attends to all of it.  Rows with `kv_lens[b] == 0` are padding and come out as zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.kernels.prefill_attention import prefill_attention_reference


def paged_attention_reference(
    q: jax.Array,             # [B, H, D]
    k_cache: jax.Array,       # [L, N, bs, KVH, D]
    v_cache: jax.Array,       # [L, N, bs, KVH, D]
    layer: jax.Array,         # [] int32
    block_tables: jax.Array,  # [B, W] int32
    kv_lens: jax.Array,       # [B] int32
    *,
    scale: float,
    soft_cap: float | None = None,
) -> jax.Array:               # [B, H, D]
    q_lens = (kv_lens > 0).astype(jnp.int32)
    out = prefill_attention_reference(q[:, None], k_cache, v_cache, layer, block_tables,
                                      q_lens, kv_lens, scale=scale, soft_cap=soft_cap)
    return out[:, 0]
