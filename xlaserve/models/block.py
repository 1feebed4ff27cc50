"""The pieces of one decoder layer that differ by family (models/families.py), called by
models/llama.decoder_layers in order: q, k, v from the residual stream (biases, q/k norms), the
attention output back into it (Gemma's post-norm), the gated MLP (SwiGLU or GeGLU, Gemma's
post-norm).  On one device without post-norms the residual add goes into the last matmul.

Einsum letters as in models/llama.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from xlaserve.kernels.matmul import gated_matmul, layer_matmul
from xlaserve.kernels.rms_norm import rms_norm
from xlaserve.models.config import ModelConfig

Params = dict[str, Any]


def rms_norm_heads(x: jax.Array,        # [T, heads, D]
                   weight: jax.Array,   # [heads, D]
                   eps: float) -> jax.Array:
    """RMSNorm over every head's features of a token together (OLMoE's q/k norm): the heads
    must all be on this device (rules.py refuses to split them)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=(-2, -1), keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def queries_keys_values(c: ModelConfig, layers: Params, w_qkv: tuple[jax.Array, ...],
                         i: jax.Array, x: jax.Array, dims: tuple[int, int, int],
                         use_kernel: bool, used: jax.Array | None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Layer i's q [T, H, D], k [T, K, D] (normed where the family norms them; RoPE comes
    with the KV write, kernels/rope_kv_write.py) and v [T, K, D] from the residual stream
    x [T, E] (its pre-norm taken in the same call); dims = (H, K, D) of this shard; rows
    from `used` on are zeros (layer_matmul's `rows`)."""
    heads, kvh, d = dims
    t = x.shape[0]
    q, k, v = layer_matmul(x, w_qkv, i, use_kernel=use_kernel,
                           norm=(layers["attn_norm"], c.rms_norm_eps), rows=used)
    if c.attention_bias:   # Qwen2: [H or K, D] per layer, this shard's heads
        q, k, v = (a + layers[b][i].reshape(-1) for a, b in zip((q, k, v), ("bq", "bk", "bv")))
    q, k = q.reshape(t, heads, d), k.reshape(t, kvh, d)
    if c.qk_norm and c.qk_norm_span == "all":   # OLMoE: over [H, D] / [K, D] at once
        q = rms_norm_heads(q, layers["q_norm"][i], c.rms_norm_eps)
        k = rms_norm_heads(k, layers["k_norm"][i], c.rms_norm_eps)
    elif c.qk_norm:        # Qwen3: RMSNorm over each head's D before RoPE
        q = rms_norm(q, layers["q_norm"][i], c.rms_norm_eps)
        k = rms_norm(k, layers["k_norm"][i], c.rms_norm_eps)
    return q, k, v.reshape(t, kvh, d)


def attention_out(c: ModelConfig, layers: Params, wo: Any, i: jax.Array,
                   attn: jax.Array,      # [T, H*D] this shard's heads
                   x: jax.Array,         # [T, E] the residual stream
                   reduce: Callable[[jax.Array], jax.Array] | None, use_kernel: bool,
                   used: jax.Array | None) -> jax.Array:   # [T, E]
    """x + attn @ wo[i] (Gemma: x + norm(attn @ wo[i])), the partial sums reduced."""
    if reduce is None and not c.post_norms:   # one device: the residual add inside the matmul
        (x,) = layer_matmul(attn, (wo,), i, use_kernel=use_kernel, residual=x, rows=used)
        return x
    (o,) = layer_matmul(attn, (wo,), i, use_kernel=use_kernel, rows=used)
    o = o if reduce is None else reduce(o)
    if c.post_norms:
        o = rms_norm(o, layers["attn_post_norm"][i], c.rms_norm_eps)
    return x + o


def mlp(c: ModelConfig, layers: Params, w_mlp: tuple[Any, ...], i: jax.Array,
         x: jax.Array,          # [T, E] the residual stream
         reduce: Callable[[jax.Array], jax.Array] | None, use_kernel: bool,
         used: jax.Array | None) -> jax.Array:   # [T, E]
    """x + mlp(norm(x)): SwiGLU, or GeGLU (tanh GELU) with Gemma's post-norm."""
    w_gate, w_up, w_down = w_mlp
    gate, up = layer_matmul(x, (w_gate, w_up), i, use_kernel=use_kernel,
                            norm=(layers["mlp_norm"], c.rms_norm_eps), rows=used)
    fused = reduce is None and not c.post_norms
    if c.mlp_activation == "silu":
        h = gated_matmul(gate, up, w_down, i, use_kernel=use_kernel,
                         residual=x if fused else None, rows=used)
    else:
        (h,) = layer_matmul(jax.nn.gelu(gate, approximate=True) * up, (w_down,), i,
                            use_kernel=use_kernel, residual=x if fused else None, rows=used)
    if fused:
        return h
    h = h if reduce is None else reduce(h)
    if c.post_norms:
        h = rms_norm(h, layers["mlp_post_norm"][i], c.rms_norm_eps)
    return x + h
