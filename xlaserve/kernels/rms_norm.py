"""RMSNorm, the decoder's pre-norm: x / sqrt(mean(x^2) + eps) * weight over the last axis.

The jnp reference here is the semantics; on the CPU kernels a layer's two pre-norms run inside
the matmul that consumes them (`layer_matmul(..., norm=...)`, kernels/matmul.py), the final
norm and the q/k norms of Qwen3 / OLMoE stay this function."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array,        # [..., K]
             weight: jax.Array,   # [K]
             eps: float) -> jax.Array:   # [..., K], x's dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)
