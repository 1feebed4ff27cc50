"""Ragged paged attention: every token of a step (decodes and prefill chunks alike) in one batch.

    q             [T, H, D]           the step's query tokens, flat, rows one after another
    k_flat/v_flat [L*N*bs, KVH, D]    the stacked cache, flat (as the layer loop carries it)
    token_rows    [T] int32           each token's row (sequence); -1 marks padding
    positions     [T] int32           each token's position in its sequence
    block_tables  [R, W] int32        each row's physical blocks
    -> out        [T, H, D]           zeros for padding tokens

Token t of row r at position p attends to row r's keys at positions max(0, p - window + 1) .. p
(its own KV is already written), key j at slot (layer * N + block_tables[r, j // bs]) * bs +
j % bs.  Query head h reads KV head h // (H / KVH) (GQA).

Three faces: the native CPU kernel (`kernels/cpu/native/paged_attention.cc`, through XLA's FFI;
it reads only a row's real blocks, whatever W is), the checked wrapper `ragged_attention`, and
`ragged_attention_reference` (pure jnp, defines the semantics: every token gathers its row's
whole W-block table, in chunks of `REFERENCE_CHUNK` tokens to bound the gathered K/V).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.cpu import build
from xlaserve.kernels.flash import MASK_VALUE
from xlaserve.kernels.kv_quant import from_cache_rows, head_dim_of
from xlaserve.kernels.validation import (
    CACHE_DTYPES,
    check_sliding_window,
    check_soft_cap,
    is_concrete,
)

# The caches the native kernel reads: float32 in place, the others converted span by span.
KERNEL_CACHE_DTYPES = tuple(jnp.dtype(d) for d in ("float32", "float16", "bfloat16", "int8"))
REFERENCE_CHUNK = 16   # tokens per gather in the reference: 16 x W*bs x KVH x D floats at once


def _reference_chunk(q: jax.Array, k_flat: jax.Array, v_flat: jax.Array, base: jax.Array,
                     token_rows: jax.Array, positions: jax.Array, block_tables: jax.Array,
                     *, block_size: int, scale: float, soft_cap: float | None,
                     sliding_window: int | None) -> jax.Array:
    # q [C, H, D]; token_rows, positions [C]; base [] = layer * N -> [C, H, D]
    c, h, d = q.shape
    kvh = k_flat.shape[1]
    g = h // kvh
    w = block_tables.shape[1]
    rows = jnp.clip(token_rows, 0, block_tables.shape[0] - 1)
    blocks = jnp.clip(block_tables[rows], 0, None)                       # [C, W]
    slots = ((base + blocks) * block_size)[:, :, None] + jnp.arange(block_size)
    slots = slots.reshape(c, w * block_size)                             # [C, S]
    k = from_cache_rows(k_flat[slots])                                   # [C, S, KVH, D]
    v = from_cache_rows(v_flat[slots])
    qg = q.astype(jnp.float32).reshape(c, kvh, g, d)
    # C token, K kv head, G group, D head dim, S key position.
    scores = jnp.einsum("ckgd,cskd->ckgs", qg, k) * scale                # [C, KVH, G, S]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(w * block_size)                                 # [S]
    valid = key_pos[None, :] <= positions[:, None]                       # [C, S]
    if sliding_window is not None:
        valid &= key_pos[None, :] > positions[:, None] - sliding_window
    scores = jnp.where(valid[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("ckgs,cskd->ckgd", probs, v).reshape(c, h, d)
    return jnp.where((token_rows >= 0)[:, None, None], out, 0.0).astype(q.dtype)


def ragged_attention_reference(
    q: jax.Array,             # [T, H, D]
    k_flat: jax.Array,        # [L*N*bs, KVH, D]
    v_flat: jax.Array,        # [L*N*bs, KVH, D]
    layer: jax.Array,         # [] int32
    token_rows: jax.Array,    # [T] int32, -1 = padding
    positions: jax.Array,     # [T] int32
    block_tables: jax.Array,  # [R, W] int32
    *,
    num_blocks: int,
    block_size: int,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:               # [T, H, D]
    t = q.shape[0]
    chunk = min(REFERENCE_CHUNK, t)
    pad = -t % chunk
    if pad:
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
        token_rows = jnp.pad(token_rows, (0, pad), constant_values=-1)
        positions = jnp.pad(positions, (0, pad))
    base = jnp.asarray(layer, jnp.int32) * num_blocks

    def one(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        q_c, rows_c, pos_c = args
        return _reference_chunk(q_c, k_flat, v_flat, base, rows_c, pos_c, block_tables,
                                block_size=block_size, scale=scale, soft_cap=soft_cap,
                                sliding_window=sliding_window)

    n = q.shape[0] // chunk
    out = jax.lax.map(one, (q.reshape(n, chunk, *q.shape[1:]), token_rows.reshape(n, chunk),
                            positions.reshape(n, chunk)))
    return out.reshape(n * chunk, *q.shape[1:])[:t]


def check_ragged_inputs(q: jax.Array, k_flat: jax.Array, v_flat: jax.Array, layer: jax.Array,
                        token_rows: jax.Array, positions: jax.Array, block_tables: jax.Array,
                        num_blocks: int, block_size: int) -> None:
    """Shapes and dtypes always; ids and positions too when they are concrete."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    if k_flat.ndim != 3 or k_flat.shape != v_flat.shape:
        raise ValueError(f"k_flat and v_flat must be one [L*N*bs, KVH, D] shape, got "
                         f"{k_flat.shape} and {v_flat.shape}")
    if k_flat.dtype != v_flat.dtype or k_flat.dtype not in CACHE_DTYPES:
        raise TypeError(f"cache dtypes must match and be float, int8 or fp8, got {k_flat.dtype} "
                        f"and {v_flat.dtype}")
    t, h, d = q.shape
    rows_total, kvh = k_flat.shape[:2]
    dk = head_dim_of(k_flat)
    if dk != d or h % kvh:
        raise ValueError(f"q [T, H={h}, D={d}] does not fit a cache of {kvh} kv heads x "
                         f"head_dim {dk}: H must be a multiple of KVH and D equal")
    if num_blocks < 1 or block_size < 1 or rows_total % (num_blocks * block_size):
        raise ValueError(f"cache rows {rows_total} are not layers x num_blocks={num_blocks} x "
                         f"block_size={block_size}")
    for name, a in (("token_rows", token_rows), ("positions", positions)):
        if a.shape != (t,) or a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [T={t}], got {a.dtype} {a.shape}")
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32 [R, W], got {block_tables.dtype} "
                         f"{block_tables.shape}")
    if jnp.shape(layer) not in ((), (1,)):
        raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
    r, w = block_tables.shape
    if is_concrete(token_rows) and is_concrete(positions):
        rows_np, pos_np = np.asarray(token_rows), np.asarray(positions)
        if rows_np.size and (rows_np.min() < -1 or rows_np.max() >= r):
            raise ValueError(f"token_rows must lie in [-1, R={r}), got {rows_np.tolist()}")
        real = pos_np[rows_np >= 0]
        if real.size and (real.min() < 0 or real.max() >= w * block_size):
            raise ValueError(f"positions of real tokens must lie in [0, W * bs = "
                             f"{w * block_size}), got {real.tolist()}")
    if is_concrete(block_tables) and block_tables.size:
        bt = np.asarray(block_tables)
        if bt.min() < 0 or bt.max() >= num_blocks:
            raise ValueError(f"block_tables holds ids outside [0, {num_blocks}): "
                             f"min {int(bt.min())}, max {int(bt.max())}")


def kernel_available(dtype: jnp.dtype) -> bool:
    """Does the native kernel serve this call (float32 on CPU, library built)?"""
    return (jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == "cpu"
            and build.load() is not None)


def ragged_attention(
    q: jax.Array,             # [T, H, D]
    k_flat: jax.Array,        # [L*N*bs, KVH, D]
    v_flat: jax.Array,        # [L*N*bs, KVH, D]
    layer: jax.Array,         # [] int32
    token_rows: jax.Array,    # [T] int32, -1 = padding
    positions: jax.Array,     # [T] int32
    block_tables: jax.Array,  # [R, W] int32
    *,
    num_blocks: int,
    block_size: int,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:               # [T, H, D] float32
    """The native CPU kernel (float32 on CPU, over a KERNEL_CACHE_DTYPES cache); raises
    ValueError where it cannot run."""
    check_ragged_inputs(q, k_flat, v_flat, layer, token_rows, positions, block_tables,
                        num_blocks, block_size)
    soft_cap = check_soft_cap(soft_cap)
    sliding_window = check_sliding_window(sliding_window)
    if not kernel_available(q.dtype) or k_flat.dtype not in KERNEL_CACHE_DTYPES:
        caches = ", ".join(d.name for d in KERNEL_CACHE_DTYPES)
        reason = build.load_error() or f"it runs float32 on CPU over a {caches} cache (got " \
                                        f"{q.dtype} over {k_flat.dtype} on " \
                                        f"{jax.default_backend()})"
        raise ValueError(f"the CPU attention kernel is not available: {reason}")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("xlaserve_cpu_paged_attention", out)(
        q, k_flat, v_flat, jnp.asarray(layer, jnp.int32).reshape(()), token_rows, positions,
        block_tables, num_blocks=np.int64(num_blocks), block_size=np.int64(block_size),
        scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=np.int64(sliding_window or 0))
