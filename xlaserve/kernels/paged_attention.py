"""Paged attention for decode: one query token per sequence over its cached KV blocks.

Row b's query is the newest token of a sequence whose KV (that token included) is `kv_lens[b]`
long; it attends to all of it.  Rows with `kv_lens[b] == 0` are padding and come out as zeros.

Three faces: `paged_attention_kernel` (the Pallas body), `paged_attention` (checks its inputs,
then runs the jitted kernel) and `paged_attention_reference` (pure jnp, defines the semantics).

How the kernel is laid out (flash-decoding):

    grid (B, KVH, S)   one program per (row, kv head, split of the block table)
    q     [B, KVH, Gp, D]     the G query heads sharing a kv head, padded to Gp (a power of two,
                              >= 16 so that the Triton dot has a legal shape): GQA without
                              repeating K/V
    split s walks table entries [s * P_s, (s + 1) * P_s) in compute blocks of `pages_per_block`
    KV blocks, stops at the row's last block, and writes an unnormalised partial (o, m, l)
    the wrapper merges the S partials with one more log-sum-exp step

The kernel uses only what the Triton backend lowers: refs indexed by `pl.ds` and by a vector of
block ids loaded from a ref (no TPU scalar prefetch), `lax.fori_loop` with a dynamic trip count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from xlaserve.kernels import flash
from xlaserve.kernels.prefill_attention import prefill_attention_reference
from xlaserve.kernels.validation import (check_block_tables, check_cache, check_int_vector,
                                         check_lengths, check_q_heads, check_sliding_window,
                                         check_soft_cap, check_triton_shapes, next_pow2,
                                         round_up)

# Programs to aim for when choosing the number of splits: a couple of waves on a 132-SM H200.
TARGET_PROGRAMS = 264


def paged_attention_kernel(
    layer_ref,         # [1] int32
    kv_len_ref,        # [1] int32: this row's cached length
    block_table_ref,   # [S * P_s] int32: this row's block ids, padded with block 0
    q_ref,             # [Gp, D]: this kv head's query heads
    k_ref,             # [L, N, bs, KVH, D]: whole stacked cache, read in place
    v_ref,             # [L, N, bs, KVH, D]
    o_ref,             # [Gp, D] float32: unnormalised partial output of this split
    m_ref,             # [Gp] float32: running max of this split's logits
    l_ref,             # [Gp] float32: softmax denominator of this split
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    pages_per_split: int,
):
    kv_head = pl.program_id(1)
    split = pl.program_id(2)
    bs = k_ref.shape[2]
    block_k = pages_per_block * bs
    layer = layer_ref[0]
    kv_len = kv_len_ref[0]
    num_pages = pl.cdiv(kv_len, bs)
    first = split * pages_per_split
    last = jnp.minimum(first + pages_per_split, num_pages)
    if sliding_window is not None:  # pages wholly before the window are never read
        first = jnp.maximum(first, jnp.maximum(kv_len - sliding_window, 0) // bs)
    steps = pl.cdiv(jnp.maximum(last - first, 0), pages_per_block)
    q = q_ref[...]                                                            # [Gp, D]

    def body(i, carry):
        page = first + i * pages_per_block
        k = flash.load_kv_pages(block_table_ref, k_ref, layer, kv_head, page, num_pages,
                                pages_per_block)                              # [block_k, D]
        v = flash.load_kv_pages(block_table_ref, v_ref, layer, kv_head, page, num_pages,
                                pages_per_block)
        key_pos = page * bs + jnp.arange(block_k, dtype=jnp.int32)            # [block_k]
        visible = key_pos < kv_len
        if sliding_window is not None:  # the query sits at kv_len - 1
            visible &= key_pos >= kv_len - sliding_window
        mask = jnp.broadcast_to(visible[None, :], (q.shape[0], block_k))
        return flash.online_softmax_update(carry, q, k, v, mask, scale=scale, soft_cap=soft_cap)

    o, m, l = lax.fori_loop(0, steps, body, flash.init_state(*q.shape))
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def default_splits(batch: int, kv_heads: int, table_blocks: int, pages_per_block: int,
                   interpret: bool) -> int:
    """Enough splits to fill the GPU when batch * kv_heads is small; one under interpretation,
    where programs run one after another and splitting only adds work."""
    if interpret:
        return 1
    most = max(1, -(-table_blocks // pages_per_block))
    return max(1, min(most, -(-TARGET_PROGRAMS // (batch * kv_heads))))


def merge_splits(
    o: jax.Array,  # [S, ..., D] float32 unnormalised partials
    m: jax.Array,  # [S, ...]
    l: jax.Array,  # [S, ...]
) -> jax.Array:    # [..., D] float32; zeros where no split saw a key
    m_all = m.max(axis=0)
    w = jnp.exp(m - m_all[None])                                              # [S, ...]
    l_all = (w * l).sum(axis=0)
    o_all = (w[..., None] * o).sum(axis=0)
    return jnp.where(l_all[..., None] > 0, o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None],
                     0.0)


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "sliding_window", "pages_per_block", "k_splits", "num_warps",
    "num_stages", "interpret"))
def _paged_attention(q, k_cache, v_cache, layer, block_tables, kv_lens, *, scale, soft_cap,
                     sliding_window, pages_per_block, k_splits, num_warps, num_stages,
                     interpret):
    b, h, d = q.shape
    _, _, _, kvh, _ = k_cache.shape
    g = h // kvh
    gp = max(16, next_pow2(g))
    pages_per_split = round_up(-(-block_tables.shape[1] // k_splits), pages_per_block)
    width = k_splits * pages_per_split
    tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))  # [B, S*P_s]
    qg = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [B,KVH,Gp,D]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)

    kernel = functools.partial(paged_attention_kernel, scale=scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_block=pages_per_block,
                               pages_per_split=pages_per_split)
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, k_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, s: (0,)),                         # layer
            pl.BlockSpec((1,), lambda i, j, s: (i,)),                         # kv_lens
            pl.BlockSpec((None, width), lambda i, j, s: (i, 0)),              # block tables
            pl.BlockSpec((None, None, gp, d), lambda i, j, s: (i, j, 0, 0)),  # q
            whole(k_cache),
            whole(v_cache),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, j, s: (s, i, j, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, s: (s, i, j, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, s: (s, i, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, b, kvh, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, b, kvh, gp), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, b, kvh, gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else flash.compiler_params(num_warps, num_stages),
        name=f"paged_attention_g{gp}_p{pages_per_block}",
    )(layer, kv_lens, tables, qg, k_cache, v_cache)
    out = merge_splits(o, m, l)[:, :, :g]                                     # [B, KVH, G, D]
    return out.reshape(b, h, d).astype(q.dtype)


def check_decode_inputs(q, k_cache, v_cache, layer, block_tables, kv_lens) -> None:
    """Shapes and dtypes always; block ids, lengths and layer too when they are concrete."""
    check_cache(k_cache, v_cache, layer)
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, D], got shape {q.shape}")
    b = q.shape[0]
    num_blocks, bs = k_cache.shape[1:3]
    check_q_heads(q, k_cache)
    check_block_tables(block_tables, b, num_blocks)
    check_int_vector("kv_lens", kv_lens, b)
    check_lengths(kv_lens, block_tables.shape[1] * bs)


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
    sliding_window: int | None = None,
    pages_per_block: int | None = None,
    k_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:               # [B, H, D]
    """Decode attention through the Pallas kernel; `interpret=True` runs it on CPU."""
    check_decode_inputs(q, k_cache, v_cache, layer, block_tables, kv_lens)
    b, _, _ = q.shape
    _, _, bs, kvh, _ = k_cache.shape
    if pages_per_block is None:
        pages_per_block = max(1, 128 // bs)
    if pages_per_block < 1 or (k_splits is not None and k_splits < 1):
        raise ValueError(f"pages_per_block and k_splits must be >= 1, got {pages_per_block}, "
                         f"{k_splits}")
    if not interpret:
        check_triton_shapes(k_cache, pages_per_block)
    if k_splits is None:
        k_splits = default_splits(b, kvh, block_tables.shape[1], pages_per_block, interpret)
    return _paged_attention(q, k_cache, v_cache, layer, block_tables, kv_lens,
                            scale=float(scale),
                            soft_cap=check_soft_cap(soft_cap),
                            sliding_window=check_sliding_window(sliding_window),
                            pages_per_block=pages_per_block, k_splits=k_splits,
                            num_warps=num_warps, num_stages=num_stages, interpret=interpret)


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
    sliding_window: int | None = None,
) -> jax.Array:               # [B, H, D]
    q_lens = (kv_lens > 0).astype(jnp.int32)
    out = prefill_attention_reference(q[:, None], k_cache, v_cache, layer, block_tables,
                                      q_lens, kv_lens, scale=scale, soft_cap=soft_cap,
                                      sliding_window=sliding_window)
    return out[:, 0]
