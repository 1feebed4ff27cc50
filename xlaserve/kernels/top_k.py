"""The k largest entries of each row: the sampler's candidates and its top logprobs.

    top_k(x [B, V], k) -> (values [B, k] descending, indices [B, k] int32)

Faces: the native CPU kernel (`kernels/cpu/native/top_k.cc`, a k-entry heap per row), the
checked wrapper `top_k`, and the reference `jax.lax.top_k` (the semantics: ties keep the lower
index first).  Why a kernel: inside the sampler's graph XLA:CPU lowers lax.top_k of a
[32, 49152] batch to a full sort of every row, ~260 ms, longer than the model's step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.kernels.cpu import build


def top_k_reference(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    return jax.lax.top_k(x, k)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, indices) of each row's k largest entries, best first."""
    if x.ndim != 2 or not 1 <= k <= x.shape[1]:
        raise ValueError(f"top_k: x must be [B, V] with 1 <= k <= V, got {x.shape} and k={k}")
    if x.dtype != jnp.float32 or jax.default_backend() != "cpu" or build.load() is None:
        return top_k_reference(x, k)
    b = x.shape[0]
    values, indices = jax.ffi.ffi_call(
        "xlaserve_cpu_top_k", (jax.ShapeDtypeStruct((b, k), jnp.float32),
                           jax.ShapeDtypeStruct((b, k), jnp.int32)))(x)
    return values, indices
