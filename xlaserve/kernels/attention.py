"""Attention backend dispatch: one call site in the model, the backend chosen by config.

`reference` is pure jnp and runs everywhere; kernels register here as they land."""

from __future__ import annotations

import jax

from xlaserve.kernels.paged_attention import paged_attention_reference
from xlaserve.kernels.prefill_attention import prefill_attention_reference

BACKENDS = ("reference", "pallas", "triton", "auto")


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "reference"
    if backend != "reference":
        raise ValueError(f"attention_backend {backend!r} is not available in this build")
    return backend


def paged_attention(
    q: jax.Array,             # [B, T, H, D]
    k_cache: jax.Array,       # [L, N, bs, KVH, D]
    v_cache: jax.Array,       # [L, N, bs, KVH, D]
    layer: jax.Array,         # [] int32
    block_tables: jax.Array,  # [B, W] int32
    q_lens: jax.Array,        # [B] int32
    kv_lens: jax.Array,       # [B] int32
    *,
    scale: float,
    backend: str = "reference",
) -> jax.Array:               # [B, T, H, D]
    """Decode (T == 1) and chunked prefill (T > 1) through one entry point."""
    backend = resolve_backend(backend)
    if q.shape[1] == 1:
        return paged_attention_reference(q[:, 0], k_cache, v_cache, layer, block_tables,
                                         kv_lens, scale=scale)[:, None]
    return prefill_attention_reference(q, k_cache, v_cache, layer, block_tables, q_lens,
                                       kv_lens, scale=scale)
