"""The quantized KV caches' rows: each token's key (or value) of one kv head as D one-byte
values (int8, or float8_e4m3fn) and its float32 scale, side by side.

    cache [L, N, bs, KVH, D + 4] int8 | float8_e4m3fn   row = q[0:D] | the 4 bytes of scale
    int8: scale = max |x| over the row's D values / 127 (1 for an all-zero row), q = round(x / s)
    fp8:  scale = max |x| / 448 (e4m3's largest finite value), q = float8_e4m3fn(x / scale)

Keeping the scale inside the row, not in a second array, leaves the cache one array per K and V
with the float cache's axes (only head_dim grows by 4): the layer loop, donation, shardings and
the pipeline carry it unchanged, and a kernel finds a row's scale where it reads the row.  For
SmolLM2 (D = 64) a token's K and V take 68 bytes a head against 256 in float32: 3.8x the tokens
in the same pool.  Every attention backend reads rows through `dequantize_rows` (jnp, Pallas)
or, for int8, its C++ twin (kernels/cpu/native/paged_attention.cc).  The fp8 cache is a GPU
option (the reference and Pallas backends read it); on the CPU backend it is refused
(kernels/quantized.check_fp8_platform) unless the test-only override is set.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from xlaserve.kernels.quantized import check_fp8_platform, is_fp8, quantize_fp8, quantize_int8

SCALE_BYTES = 4


def has_row_scales(dtype: Any) -> bool:
    """Is a cache of `dtype` quantized rows (int8 or fp8) with their scales inside?"""
    return jnp.dtype(dtype) == jnp.int8 or is_fp8(dtype)


def row_width(head_dim: int, dtype: Any) -> int:
    """The cache's last axis for `head_dim`: D, or D + 4 for an int8 or fp8 cache."""
    return head_dim + SCALE_BYTES if has_row_scales(dtype) else head_dim


def head_dim_of(cache: jax.Array) -> int:
    """D of a cache (or cache-shaped rows) whatever its dtype."""
    return cache.shape[-1] - (SCALE_BYTES if has_row_scales(cache.dtype) else 0)


def quantize_rows(x: jax.Array, dtype: Any = jnp.int8) -> jax.Array:
    """x [..., D] float -> [..., D + 4] rows of `dtype` (int8 or float8_e4m3fn; see the module
    docstring): the weights' quantizer with the whole row as one group."""
    quantize = quantize_fp8 if is_fp8(dtype) else quantize_int8
    rows = quantize(x, -1, group=x.shape[-1])               # q [..., D], scale [..., 1]
    scale_bytes = lax.bitcast_convert_type(rows["scale"][..., 0], rows["q"].dtype)  # [..., 4]
    return jnp.concatenate([rows["q"], scale_bytes], axis=-1)


def dequantize_rows(rows: jax.Array) -> jax.Array:
    """[..., D + 4] int8 or float8_e4m3fn rows -> [..., D] float32."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = lax.bitcast_convert_type(rows[..., d:], jnp.float32)         # [...]
    return rows[..., :d].astype(jnp.float32) * scale[..., None]


def to_cache_rows(x: jax.Array, dtype: Any) -> jax.Array:
    """New keys or values [..., D] as the cache of `dtype` stores them."""
    if is_fp8(dtype):
        check_fp8_platform("kv_cache_dtype='fp8'")
    return quantize_rows(x, dtype) if has_row_scales(dtype) else x.astype(dtype)


def from_cache_rows(rows: jax.Array) -> jax.Array:
    """Cache rows as float32 [..., D], whatever the cache's dtype."""
    return dequantize_rows(rows) if has_row_scales(rows.dtype) else rows.astype(jnp.float32)
