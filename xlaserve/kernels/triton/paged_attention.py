"""Paged decode attention through a jax-triton kernel: same interface as the Pallas op in
`kernels/paged_attention.py`, used only on GPU.

Three faces: the Triton kernel body (`decode_kernel.paged_decode_kernel`, imported on first
call because jax-triton needs a GPU at import), `paged_attention` (checks its inputs, then runs
the jitted kernel) and `paged_attention_reference` (the same pure-jnp reference as the Pallas op).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xlaserve.kernels.paged_attention import (check_decode_inputs, default_splits,
                                              merge_splits, paged_attention_reference)
from xlaserve.kernels.validation import check_soft_cap, check_triton_shapes, next_pow2, round_up

__all__ = ["paged_attention", "paged_attention_reference"]


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "pages_per_block", "k_splits", "num_warps", "num_stages"))
def _paged_attention(q, k_cache, v_cache, layer, block_tables, kv_lens, *, scale, soft_cap,
                     pages_per_block, k_splits, num_warps, num_stages):
    import jax_triton as jt

    from xlaserve.kernels.triton.decode_kernel import paged_decode_kernel

    b, h, d = q.shape
    _, num_blocks, bs, kvh, _ = k_cache.shape
    g = h // kvh
    gp = max(16, next_pow2(g))
    pages_per_split = round_up(-(-block_tables.shape[1] // k_splits), pages_per_block)
    width = k_splits * pages_per_split
    tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))  # [B, S*P_s]
    qg = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [B,KVH,Gp,D]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    o, m, l = jt.triton_call(
        layer, kv_lens, tables, qg, k_cache, v_cache,
        kernel=paged_decode_kernel,
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, b, kvh, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, b, kvh, gp), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, b, kvh, gp), jnp.float32),
        ],
        grid=(b, kvh, k_splits),
        num_warps=num_warps,
        num_stages=num_stages,
        SCALE=scale, SOFT_CAP=soft_cap or 0.0, BATCH=b, NUM_BLOCKS=num_blocks, BS=bs, KVH=kvh,
        D=d, GP=gp, WIDTH=width, PAGES=pages_per_block, PAGES_PER_SPLIT=pages_per_split,
        PRECISION="ieee" if q.dtype == jnp.float32 else "tf32",
    )
    out = merge_splits(o, m, l)[:, :, :g]                                     # [B, KVH, G, D]
    return out.reshape(b, h, d).astype(q.dtype)


def paged_attention(
    q: jax.Array,             # [B, H, D]
    k_cache: jax.Array,       # [L, N, bs, KVH, D]
    v_cache: jax.Array,       # [L, N, bs, KVH, D]
    layer: jax.Array,         # [] int32
    block_tables: jax.Array,  # [B, W] int32
    kv_lens: jax.Array,       # [B] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    pages_per_block: int | None = None,
    k_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:               # [B, H, D]
    """Decode attention through the jax-triton kernel (GPU only)."""
    platform = jax.default_backend()
    if platform != "gpu":
        raise ValueError(f"the triton decode kernel needs a GPU; platform is {platform!r} "
                         f"(jax-triton needs a GPU)")
    check_decode_inputs(q, k_cache, v_cache, layer, block_tables, kv_lens)
    _, _, bs, kvh, _ = k_cache.shape
    if pages_per_block is None:
        pages_per_block = max(1, 128 // bs)
    soft_cap = check_soft_cap(soft_cap)
    check_triton_shapes(k_cache, pages_per_block)
    if k_splits is None:
        k_splits = default_splits(q.shape[0], kvh, block_tables.shape[1], pages_per_block,
                                  interpret=False)
    return _paged_attention(q, k_cache, v_cache, layer, block_tables, kv_lens,
                            scale=float(scale),
                            soft_cap=None if soft_cap is None else float(soft_cap),
                            pages_per_block=pages_per_block, k_splits=k_splits,
                            num_warps=num_warps, num_stages=num_stages)
