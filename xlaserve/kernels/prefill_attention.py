"""Ragged paged attention for a chunk of query tokens per sequence (chunked prefill, prefix hits).

Row b holds `q_lens[b]` query tokens: the newest tokens of a sequence whose KV (already written
to the cache, this chunk included) is `kv_lens[b]` long.  Query token t sits at absolute position
`kv_lens[b] - q_lens[b] + t` and attends causally to every cached token at or before it, read
through the row's block table.  Query slots t >= q_lens[b] are padding and come out as zeros.

The cache keeps every layer: `[layers, blocks, block_size, kv_heads, head_dim]`, and `layer` picks
one, so that a kernel reads the stacked cache in place instead of a copied slice.

Three faces: `prefill_attention_kernel` (the Pallas body), `prefill_attention` (checks its inputs,
then runs the jitted kernel) and `prefill_attention_reference` (pure jnp, defines the semantics).

How the kernel is laid out:

    grid (B, KVH, Tp / block_q)   one program per (row, kv head, tile of block_q query tokens)
    q    [B, KVH, Tp * Gp, D]     query row r of a tile is token t0 + r // Gp, head g = r % Gp of
                                  the kv head's group (G padded to a power of two Gp): all heads
                                  of a GQA group share each K/V load
    a tile walks the row's block table from key 0 in compute blocks of `pages_per_block` KV
    blocks up to its last valid query's position (causal: later keys are never loaded), masks
    key > query position and key >= kv_len, and writes normalised rows; padding rows are zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from xlaserve.kernels import flash
from xlaserve.kernels.kv_quant import from_cache_rows
from xlaserve.kernels.validation import (check_block_tables, check_cache, check_int_vector,
                                         check_lengths, check_q_heads, check_sliding_window,
                                         check_soft_cap, check_triton_shapes, next_pow2,
                                         round_up)



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
    sliding_window: int | None = None,
) -> jax.Array:               # [B, T, H, D]
    b, t, h, d = q.shape
    kvh = k_cache.shape[3]
    g = h // kvh
    k = from_cache_rows(gather_kv(k_cache, layer, block_tables))     # [B, S, KVH, D]
    v = from_cache_rows(gather_kv(v_cache, layer, block_tables))
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
    if sliding_window is not None:  # the last `sliding_window` positions, the query's included
        valid &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    scores = jnp.where(valid[:, None, None], scores, flash.MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)
    q_valid = jnp.arange(t)[None, :] < q_lens[:, None]                 # [B, T]
    return jnp.where(q_valid[:, :, None, None], out, 0.0).astype(q.dtype)


def prefill_attention_kernel(
    layer_ref,         # [1] int32
    q_len_ref,         # [1] int32: real query tokens in this row
    kv_len_ref,        # [1] int32: cached tokens of this row, the chunk included
    block_table_ref,   # [W'] int32: this row's block ids, padded with block 0
    q_ref,             # [block_q * Gp, D]: one tile of (token, head) query rows
    k_ref,             # [L, N, bs, KVH, D]: whole stacked cache, read in place
    v_ref,             # [L, N, bs, KVH, D]
    o_ref,             # [block_q * Gp, D]
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    block_q: int,
    group: int,        # Gp
):
    kv_head = pl.program_id(1)
    tile = pl.program_id(2)
    bs = k_ref.shape[2]
    block_k = pages_per_block * bs
    rows = block_q * group
    layer = layer_ref[0]
    q_len = q_len_ref[0]
    kv_len = kv_len_ref[0]
    start = kv_len - q_len                       # absolute position of the chunk's token 0
    t0 = tile * block_q
    t = t0 + lax.broadcasted_iota(jnp.int32, (block_q, group), 0).reshape(rows)  # [rows]
    q_pos = start + t                                                         # [rows]
    row_valid = t < q_len                                                     # [rows]
    # Keys [0, end) are all this tile's valid queries can see; an all-padding tile loads none.
    end = jnp.where(t0 < q_len, start + jnp.minimum(t0 + block_q, q_len), 0)
    num_pages = pl.cdiv(kv_len, bs)
    steps = pl.cdiv(end, block_k)
    q = q_ref[...]                                                            # [rows, D]

    def body(i, carry):
        page = i * pages_per_block
        k = flash.load_kv_pages(block_table_ref, k_ref, layer, kv_head, page, num_pages,
                                pages_per_block)                              # [block_k, D]
        v = flash.load_kv_pages(block_table_ref, v_ref, layer, kv_head, page, num_pages,
                                pages_per_block)
        key_pos = page * bs + jnp.arange(block_k, dtype=jnp.int32)            # [block_k]
        mask = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < kv_len)
        if sliding_window is not None:
            mask &= key_pos[None, :] > q_pos[:, None] - sliding_window
        return flash.online_softmax_update(carry, q, k, v, mask, scale=scale, soft_cap=soft_cap)

    o, _, l = lax.fori_loop(0, steps, body, flash.init_state(rows, q.shape[1]))
    keep = row_valid & (l > 0)
    out = o / jnp.where(keep, l, 1.0)[:, None]
    o_ref[...] = jnp.where(keep[:, None], out, 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "sliding_window", "pages_per_block", "block_q", "num_warps",
    "num_stages", "interpret"))
def _prefill_attention(q, k_cache, v_cache, layer, block_tables, q_lens, kv_lens, *, scale,
                       soft_cap, sliding_window, pages_per_block, block_q, num_warps, num_stages,
                       interpret):
    b, t, h, d = q.shape
    kvh = k_cache.shape[3]
    g = h // kvh
    gp = next_pow2(g)
    tp = round_up(t, block_q)
    width = round_up(block_tables.shape[1], pages_per_block)
    tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))  # [B, W']
    qg = q.reshape(b, t, kvh, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, tp - t), (0, 0), (0, gp - g), (0, 0)))  # [B, Tp, KVH, Gp, D]
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(b, kvh, tp * gp, d)          # [B, KVH, Tp*Gp, D]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    rows = block_q * gp

    kernel = functools.partial(prefill_attention_kernel, scale=scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_block=pages_per_block,
                               block_q=block_q, group=gp)
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(b, kvh, tp // block_q),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, s: (0,)),                         # layer
            pl.BlockSpec((1,), lambda i, j, s: (i,)),                         # q_lens
            pl.BlockSpec((1,), lambda i, j, s: (i,)),                         # kv_lens
            pl.BlockSpec((None, width), lambda i, j, s: (i, 0)),              # block tables
            pl.BlockSpec((None, None, rows, d), lambda i, j, s: (i, j, s, 0)),  # q
            whole(k_cache),
            whole(v_cache),
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda i, j, s: (i, j, s, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, tp * gp, d), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else flash.compiler_params(num_warps, num_stages),
        name=f"prefill_attention_g{gp}_q{block_q}_p{pages_per_block}",
    )(layer, q_lens, kv_lens, tables, qg, k_cache, v_cache)
    out = out.reshape(b, kvh, tp, gp, d).transpose(0, 2, 1, 3, 4)[:, :t, :, :g]
    return out.reshape(b, t, h, d)


def check_prefill_inputs(q, k_cache, v_cache, layer, block_tables, q_lens, kv_lens) -> None:
    """Shapes and dtypes always; block ids, lengths and layer too when they are concrete."""
    check_cache(k_cache, v_cache, layer)
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {q.shape}")
    b, t = q.shape[:2]
    num_blocks, bs = k_cache.shape[1:3]
    check_q_heads(q, k_cache)
    check_block_tables(block_tables, b, num_blocks)
    check_int_vector("q_lens", q_lens, b)
    check_int_vector("kv_lens", kv_lens, b)
    check_lengths(kv_lens, block_tables.shape[1] * bs, q_lens, t)


def default_block_q(chunk: int, group: int) -> int:
    """Tokens per tile: about 64 (token, head) rows, at least 16 (the Triton dot's minimum)."""
    gp = next_pow2(group)
    return max(max(1, 16 // gp), min(max(1, 64 // gp), next_pow2(chunk)))


def prefill_attention(
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
    sliding_window: int | None = None,
    pages_per_block: int | None = None,
    block_q: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:               # [B, T, H, D]
    """Ragged chunked-prefill attention through the Pallas kernel; `interpret=True` on CPU."""
    check_prefill_inputs(q, k_cache, v_cache, layer, block_tables, q_lens, kv_lens)
    _, t, h, _ = q.shape
    bs, kvh = k_cache.shape[2], k_cache.shape[3]
    if pages_per_block is None:
        pages_per_block = max(1, 64 // bs)
    if block_q is None:
        block_q = default_block_q(t, h // kvh)
    if pages_per_block < 1 or block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"pages_per_block must be >= 1 and block_q a power of two, got "
                         f"{pages_per_block}, {block_q}")
    if not interpret:
        check_triton_shapes(k_cache, pages_per_block)
    return _prefill_attention(q, k_cache, v_cache, layer, block_tables, q_lens, kv_lens,
                              scale=float(scale),
                              soft_cap=check_soft_cap(soft_cap),
                              sliding_window=check_sliding_window(sliding_window),
                              pages_per_block=pages_per_block, block_q=block_q,
                              num_warps=num_warps, num_stages=num_stages, interpret=interpret)
