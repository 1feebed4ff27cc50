"""Input checks shared by the attention kernels' wrappers.

Shapes and dtypes are static, so they are checked on every call, traced or not.  Values (block
ids, lengths) can only be checked when the caller passes concrete arrays; under `jit` they are
tracers and the kernels instead clamp what they read so that a bad id can never address memory
outside the cache."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.kv_quant import has_row_scales, head_dim_of

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# A cache is float, or int8 / fp8 rows with their scales inside (kernels/kv_quant.py).
CACHE_DTYPES = (*FLOAT_DTYPES, jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_cache(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array) -> None:
    if k_cache.ndim != 5:
        raise ValueError(f"k_cache must be [L, N, bs, KVH, D], got shape {k_cache.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {k_cache.shape} vs {v_cache.shape}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    if k_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"cache dtype must be one of {[str(d) for d in CACHE_DTYPES]}, "
                        f"got {k_cache.dtype}")
    if jnp.shape(layer) not in ((), (1,)):
        raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
    if not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise TypeError(f"layer must be an integer, got {jnp.result_type(layer)}")
    num_layers = k_cache.shape[0]
    if is_concrete(layer):
        value = int(np.asarray(layer).reshape(()))
        if not 0 <= value < num_layers:
            raise ValueError(f"layer={value} out of range [0, {num_layers})")


def check_q_heads(q: jax.Array, k_cache: jax.Array) -> None:
    """q: [..., H, D] against k_cache [L, N, bs, KVH, D]: same head_dim and dtype, and whole
    query-head groups per KV head."""
    h, d = q.shape[-2:]
    kvh, dk = k_cache.shape[-2], head_dim_of(k_cache)
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) != head_dim of the cache ({dk})")
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    if q.dtype != k_cache.dtype and not has_row_scales(k_cache.dtype):
        raise TypeError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")


def check_int_vector(name: str, x: jax.Array, batch: int) -> None:
    if x.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one entry per row), got {x.shape}")
    if x.dtype != jnp.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")


def check_block_tables(block_tables: jax.Array, batch: int, num_blocks: int) -> None:
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, W], got shape {block_tables.shape}")
    if block_tables.dtype != jnp.int32:
        raise TypeError(f"block_tables must be int32, got {block_tables.dtype}")
    if is_concrete(block_tables) and block_tables.size:
        bt = np.asarray(block_tables)
        bad = np.argwhere((bt < 0) | (bt >= num_blocks))
        if bad.size:
            row, col = (int(i) for i in bad[0])
            raise ValueError(
                f"block_tables holds {len(bad)} block id(s) out of range [0, {num_blocks}); "
                f"first at [{row}, {col}] = {int(bt[row, col])}")


def check_lengths(kv_lens: jax.Array, capacity: int, q_lens: jax.Array | None = None,
                  chunk: int | None = None) -> None:
    """kv_lens <= W * bs; and for prefill q_lens <= T and q_lens <= kv_lens."""
    if not is_concrete(kv_lens) or (q_lens is not None and not is_concrete(q_lens)):
        return
    kv = np.asarray(kv_lens)
    if kv.size and (kv.min() < 0 or kv.max() > capacity):
        raise ValueError(f"kv_lens must lie in [0, W * bs = {capacity}], got {kv.tolist()}")
    if q_lens is None:
        return
    q = np.asarray(q_lens)
    if q.size and (q.min() < 0 or chunk is not None and q.max() > chunk):
        raise ValueError(f"q_lens must lie in [0, T = {chunk}], got {q.tolist()}")
    if np.any(q > kv):
        raise ValueError(f"q_lens must not exceed kv_lens (the chunk is already in the cache): "
                         f"q_lens={q.tolist()} kv_lens={kv.tolist()}")


def check_soft_cap(soft_cap: float | None) -> float | None:
    """None (no cap) or a positive float: logits become soft_cap * tanh(logits / soft_cap)."""
    if soft_cap is None:
        return None
    if isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float)) or not (
            soft_cap > 0):
        raise ValueError(f"soft_cap must be a positive number or None, got {soft_cap!r}")
    return float(soft_cap)


def check_sliding_window(sliding_window: int | None) -> int | None:
    """None (full causal attention) or a positive int: each query sees that many positions,
    its own included."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or (
            sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got "
                         f"{sliding_window!r}")
    return sliding_window


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def check_triton_shapes(k_cache: jax.Array, pages_per_block: int) -> None:
    """The Triton lowering needs power-of-two load shapes."""
    _, _, bs, _, d = k_cache.shape
    for name, n in (("block_size", bs), ("head_dim", d), ("pages_per_block", pages_per_block)):
        if n & (n - 1):
            raise ValueError(f"on GPU {name} must be a power of two, got {n}")
