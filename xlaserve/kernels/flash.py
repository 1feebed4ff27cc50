"""Building blocks shared by the Pallas attention kernels (inside a kernel body only).

Both kernels walk a row's block table one compute block (`pages` KV blocks) at a time and keep
the flash-attention running state per query row:

    m [R]     running max of the logits seen so far
    l [R]     running sum of exp(logit - m)
    o [R, D]  running sum of exp(logit - m) * v            (unnormalised; divide by l at the end)

Every compute block that a kernel visits holds at least one key its valid query rows may see
(the walk starts at key 0 and stops at the last key needed), so after the first block m is a real
logit and masked keys contribute exp(MASK - m) == 0 exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from xlaserve.kernels.kv_quant import dequantize_rows, has_row_scales

# Finite, so that exp(MASK - MASK) on a never-visited row is 1 rather than NaN; the rows it
# touches have l == 0 and are written as zeros.
MASK_VALUE = -1e30


def load_kv_pages(
    block_table_ref,    # [W'] int32: this row's block ids (W' >= first_page + pages)
    cache_ref,          # [L, N, bs, KVH, D]: the whole stacked cache, read in place
    layer: jax.Array,   # [] int32
    kv_head: jax.Array,  # [] int32
    first_page: jax.Array,  # [] int32: index into the block table
    num_pages: jax.Array,   # [] int32: pages holding keys of this row; later entries are ignored
    pages: int,
) -> jax.Array:         # [pages * bs, D]
    """One compute block of keys or values: `pages` KV blocks gathered through the table.

    Table entries past the row's length may be stale or padding, so they are replaced by block 0
    and every id is clamped into [0, N): a load never leaves the cache."""
    num_blocks, bs = cache_ref.shape[1], cache_ref.shape[2]
    page_idx = first_page + jnp.arange(pages, dtype=jnp.int32)                 # [pages]
    ids = block_table_ref[pl.ds(first_page, pages)]                           # [pages]
    ids = jnp.where(page_idx < num_pages, ids, 0)
    ids = jnp.minimum(jnp.maximum(ids, 0), num_blocks - 1)
    block = cache_ref[layer, ids, :, kv_head, :]                              # [pages, bs, D']
    if has_row_scales(block.dtype):   # int8 / fp8 rows [.., D + 4] (kv_quant.py) -> float32
        block = dequantize_rows(block)
    return block.reshape(pages * bs, block.shape[-1])


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, D] . b [N, D]^T -> [M, N] float32; exact (IEEE) for float32 inputs, not TF32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] . b [K, N] -> [M, N] float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def online_softmax_update(
    carry: tuple[jax.Array, jax.Array, jax.Array],  # o [R, D] f32, m [R] f32, l [R] f32
    q: jax.Array,       # [R, D]
    k: jax.Array,       # [C, D]
    v: jax.Array,       # [C, D]
    mask: jax.Array,    # [R, C] bool: key c visible to query row r
    *,
    scale: float,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    o_prev, m_prev, l_prev = carry
    logits = dot_nt(q, k) * scale                                             # [R, C]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(mask, logits, MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=-1))                         # [R]
    correction = jnp.exp(m_prev - m_next)                                     # [R]
    p = jnp.exp(logits - m_next[:, None])                                     # [R, C]
    l_next = correction * l_prev + p.sum(axis=-1)
    o_next = correction[:, None] * o_prev + dot_nn(p.astype(v.dtype), v)      # [R, D]
    return o_next, m_next, l_next


def init_state(rows: int, d: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def compiler_params(num_warps: int, num_stages: int):
    """Triton compile options; the class was renamed across jax releases."""
    from jax.experimental.pallas import triton as plgpu

    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)
