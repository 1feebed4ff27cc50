"""RoPE and the KV-cache write of one layer: the step's q and k rotated, its k and v stored.

    q             [T, H, D]           queries before RoPE     -> q rotated [T, H, D]
    k, v          [T, KVH, D]         new keys (before RoPE) and values
    cos, sin      [T, D/2]            each token's rotation (models/rope.rope_tables)
    k_flat/v_flat [L*N*bs, KVH, D]    the stacked cache, flat (as the layer loop carries it)
    layer         [] int32
    slot_mapping  [T] int32           each token's cell in a layer's N*bs rows
    -> (q rotated, k_flat with row layer*N*bs + slot = rotate(k), v_flat with that row = v)

RoPE is the "rotate half" layout (HF's): out[:D/2] = x1 cos - x2 sin, out[D/2:] = x2 cos +
x1 sin.  A token whose row falls past the cache writes nothing (pipeline bubbles rely on it);
a negative row counts from the end, as jnp's .at[] does.

Three faces: the native CPU kernel (`kernels/cpu/native/rope_kv_write.cc`, one FFI call in
place of XLA's rotation and scatter fusions; the caches are its outputs aliased to its inputs,
so the layer loop's carried buffer is written in place), the checked wrapper
`rope_kv_write_kernel`, and `rope_kv_write_reference` (pure jnp, defines the semantics).
`rope_kv_write` picks: the kernel for a float32 cache when asked, the reference otherwise (a
quantized cache's rows are made by kernels/kv_quant.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.cpu import build
from xlaserve.kernels.kv_quant import to_cache_rows


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., N, D] rotated by cos, sin [..., D // 2], every head alike."""
    cos, sin = cos[..., None, :], sin[..., None, :]                    # [..., 1, D/2]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rope_kv_write_reference(q: jax.Array, k: jax.Array, v: jax.Array, cos: jax.Array,
                            sin: jax.Array, k_flat: jax.Array, v_flat: jax.Array,
                            layer: jax.Array, slot_mapping: jax.Array, *, rows_per_layer: int,
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    dest = layer * rows_per_layer + slot_mapping                         # [T]
    k_flat = k_flat.at[dest].set(to_cache_rows(rotate(k, cos, sin), k_flat.dtype), mode="drop")
    v_flat = v_flat.at[dest].set(to_cache_rows(v, v_flat.dtype), mode="drop")
    return rotate(q, cos, sin), k_flat, v_flat


def check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, cos: jax.Array, sin: jax.Array,
                 k_flat: jax.Array, v_flat: jax.Array, slot_mapping: jax.Array,
                 rows_per_layer: int) -> None:
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] \
            or k.shape[2] != q.shape[2] or q.shape[2] % 2:
        raise ValueError(f"q must be [T, H, D] and k, v [T, KVH, D] with D even, got q "
                         f"{q.shape}, k {k.shape}, v {v.shape}")
    t, _, d = q.shape
    if cos.shape != (t, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [T={t}, D/2={d // 2}], got {cos.shape} and "
                         f"{sin.shape}")
    if k_flat.shape != v_flat.shape or k_flat.ndim != 3 or k_flat.shape[1] != k.shape[1]:
        raise ValueError(f"k_flat and v_flat must be one [L*N*bs, KVH={k.shape[1]}, row] "
                         f"shape, got {k_flat.shape} and {v_flat.shape}")
    if rows_per_layer < 1 or k_flat.shape[0] % rows_per_layer:
        raise ValueError(f"cache rows {k_flat.shape[0]} are not a multiple of "
                         f"rows_per_layer={rows_per_layer}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be int32 [T={t}], got {slot_mapping.dtype} "
                         f"{slot_mapping.shape}")


def kernel_available(cache_dtype: jnp.dtype) -> bool:
    """Does the native kernel serve a float32 cache here (CPU, library built)?"""
    return (jnp.dtype(cache_dtype) == jnp.float32 and jax.default_backend() == "cpu"
            and build.load() is not None)


def rope_kv_write_kernel(q: jax.Array, k: jax.Array, v: jax.Array, cos: jax.Array,
                         sin: jax.Array, k_flat: jax.Array, v_flat: jax.Array, layer: jax.Array,
                         slot_mapping: jax.Array, *, rows_per_layer: int,
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The native CPU kernel (float32 throughout); raises ValueError where it cannot run."""
    check_inputs(q, k, v, cos, sin, k_flat, v_flat, slot_mapping, rows_per_layer)
    arrays = (q, k, v, cos, sin, k_flat, v_flat)
    if not kernel_available(k_flat.dtype) or any(a.dtype != jnp.float32 for a in arrays):
        reason = build.load_error() or f"it runs float32 on CPU (got q {q.dtype}, cache " \
                                        f"{k_flat.dtype} on {jax.default_backend()})"
        raise ValueError(f"the CPU rope_kv_write kernel is not available: {reason}")
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
           jax.ShapeDtypeStruct(k_flat.shape, jnp.float32),
           jax.ShapeDtypeStruct(v_flat.shape, jnp.float32))
    call = jax.ffi.ffi_call("xlaserve_cpu_rope_kv_write", out, input_output_aliases={5: 1, 6: 2})
    return call(*arrays, jnp.asarray(layer, jnp.int32).reshape(()), slot_mapping,
                rows_per_layer=np.int64(rows_per_layer))


def rope_kv_write(q: jax.Array, k: jax.Array, v: jax.Array, cos: jax.Array, sin: jax.Array,
                  k_flat: jax.Array, v_flat: jax.Array, layer: jax.Array,
                  slot_mapping: jax.Array, *, rows_per_layer: int, use_kernel: bool = False,
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q rotated, and the caches with the step's keys (rotated) and values written: the
    kernel when `use_kernel` and everything is float32, else the reference."""
    args = (q, k, v, cos, sin, k_flat, v_flat, layer, slot_mapping)
    if use_kernel and all(a.dtype == jnp.float32 for a in args[:7]) \
            and kernel_available(k_flat.dtype):
        return rope_kv_write_kernel(*args, rows_per_layer=rows_per_layer)
    return rope_kv_write_reference(*args, rows_per_layer=rows_per_layer)
