"""The Llama-family decoder (Llama 2/3, Mistral, SmolLM2) as pure functions over a param pytree.

    tokens [B, T] -> embed -> scan over layers {
        x += attn(rmsnorm(x))   q,k,v projections; RoPE; write k,v into the paged cache at
                                `slot_mapping`; paged attention over the row's block table
        x += mlp(rmsnorm(x))    SwiGLU
    } -> rmsnorm -> logits (tied or separate output embedding)

Layers are stacked on a leading `layers` axis and run under `lax.scan`, so compile time does not
grow with depth.  The KV cache goes in as an argument and comes out as a return value.

Einsum letters: B batch rows, T tokens per row, E embed, H query heads, K kv heads, D head dim,
F mlp hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.attention import paged_attention
from xlaserve.models.config import ModelConfig
from xlaserve.models.rope import apply_rope, inverse_frequencies

Params = dict[str, Any]


class KVCache(NamedTuple):
    k: jax.Array  # [L, N, bs, K, D]
    v: jax.Array  # [L, N, bs, K, D]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


class AttentionMetadata(NamedTuple):
    """Where each row's tokens go in the cache and what they attend to.

    Row b feeds `q_lens[b]` real tokens (the rest of its T slots are padding); after they are
    written its sequence holds `kv_lens[b]` cached tokens.  Padding tokens write to slot 0, in
    the reserved null block."""

    block_tables: jax.Array  # [B, W] int32 physical block ids, 0-padded
    q_lens: jax.Array        # [B] int32
    kv_lens: jax.Array       # [B] int32
    slot_mapping: jax.Array  # [B, T] int32 block_id * block_size + offset


# Logical axis names of every parameter (see sharding/rules.py).
def param_axes(config: ModelConfig) -> Params:
    axes: Params = {
        "embed": ("vocab", "embed"),
        "layers": {
            "attn_norm": ("layers", "embed"),
            "wq": ("layers", "embed", "heads", "head_dim"),
            "wk": ("layers", "embed", "kv_heads", "head_dim"),
            "wv": ("layers", "embed", "kv_heads", "head_dim"),
            "wo": ("layers", "heads", "head_dim", "embed"),
            "mlp_norm": ("layers", "embed"),
            "w_gate": ("layers", "embed", "mlp"),
            "w_up": ("layers", "embed", "mlp"),
            "w_down": ("layers", "mlp", "embed"),
        },
        "final_norm": ("embed",),
    }
    if not config.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


KV_AXES = ("layers", "blocks", "block_size", "kv_heads", "head_dim")


def param_shapes(config: ModelConfig) -> Params:
    c = config
    L, E, H, K, D, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                           c.intermediate_size, c.vocab_size)
    shapes: Params = {
        "embed": (V, E),
        "layers": {
            "attn_norm": (L, E), "wq": (L, E, H, D), "wk": (L, E, K, D), "wv": (L, E, K, D),
            "wo": (L, H, D, E), "mlp_norm": (L, E),
            "w_gate": (L, E, F), "w_up": (L, E, F), "w_down": (L, F, E),
        },
        "final_norm": (E,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


def init_params(config: ModelConfig, seed: int = 0, scale: float = 0.02) -> Params:
    """Random parameters (host numpy), for tests and tiny models."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(config.dtype)

    def make(path: tuple[Any, ...], shape: tuple[int, ...]) -> np.ndarray:
        name = path[-1].key
        if name.endswith("norm"):
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            arr = scale * rng.standard_normal(shape)
        return arr.astype(dtype)

    return jax.tree_util.tree_map_with_path(make, param_shapes(config),
                                            is_leaf=lambda x: isinstance(x, tuple))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def decoder_layer(
    config: ModelConfig,
    layer: Params,              # one layer's weights (this shard's heads / mlp slice)
    x: jax.Array,               # [B, T, E]
    k_flat: jax.Array,          # [L*N*bs, K, D] the whole (local) cache, flattened
    v_flat: jax.Array,          # [L*N*bs, K, D]
    i: jax.Array,               # [] int32 layer index into the (local) cache
    positions: jax.Array,       # [B, T] int32
    meta: AttentionMetadata,
    inv_freq: jax.Array,        # [D // 2]
    cache_shape: tuple[int, ...],
    *,
    attention_backend: str = "reference",
    attend: Callable[..., jax.Array] = paged_attention,
    reduce: Callable[[jax.Array], jax.Array] = lambda y: y,
) -> tuple[jax.Array, jax.Array, jax.Array]:   # x [B, T, E], k_flat, v_flat
    """One pre-norm block: x += attn(norm(x)); x += mlp(norm(x)).

    Under tensor parallelism (sharding/parallel_forward.py) `layer` holds one shard's heads and
    mlp slice, so the outputs of `wo` and `w_down` are partial sums that `reduce` adds up over
    the shards, and `attend` may stand in for `paged_attention` with the same signature.
    KV writes to slots outside the cache are dropped (pipeline bubbles rely on it)."""
    c = config
    b, t = x.shape[:2]
    num_blocks, block_size, kvh, d = cache_shape[1:]
    dest = i * num_blocks * block_size + meta.slot_mapping.reshape(-1)  # [B*T]
    h = rms_norm(x, layer["attn_norm"], c.rms_norm_eps)
    q = jnp.einsum("bte,ehd->bthd", h, layer["wq"])
    k = jnp.einsum("bte,ekd->btkd", h, layer["wk"])
    v = jnp.einsum("bte,ekd->btkd", h, layer["wv"])
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    k_flat = k_flat.at[dest].set(k.reshape(b * t, kvh, d).astype(k_flat.dtype), mode="drop")
    v_flat = v_flat.at[dest].set(v.reshape(b * t, kvh, d).astype(v_flat.dtype), mode="drop")
    attn = attend(q, k_flat.reshape(cache_shape), v_flat.reshape(cache_shape), i,
                  meta.block_tables, meta.q_lens, meta.kv_lens, scale=d ** -0.5,
                  sliding_window=c.sliding_window, backend=attention_backend)  # [B, T, H, D]
    # wo as a [H*D, E] matrix: contracting one merged axis keeps XLA from transposing the
    # weight (a copy of it every step) to match the activation's head order.
    b, t, h, d = attn.shape
    wo = layer["wo"].reshape(h * d, -1)
    x = x + reduce(jnp.einsum("btj,je->bte", attn.reshape(b, t, h * d), wo))
    h = rms_norm(x, layer["mlp_norm"], c.rms_norm_eps)
    gate = jnp.einsum("bte,ef->btf", h, layer["w_gate"])
    up = jnp.einsum("bte,ef->btf", h, layer["w_up"])
    x = x + reduce(jnp.einsum("btf,fe->bte", jax.nn.silu(gate) * up, layer["w_down"]))
    return x, k_flat, v_flat


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,       # [B, T] int32
    positions: jax.Array,    # [B, T] int32
    kv: KVCache,
    meta: AttentionMetadata,
    *,
    logits_index: jax.Array | None = None,  # [B] int32: one token per row, or None for all
    attention_backend: str = "reference",
) -> tuple[jax.Array, KVCache]:             # logits [B, V] or [B, T, V] float32; new cache
    c = config
    _, _, _, kvh, d = kv.k.shape
    inv_freq = jnp.asarray(inverse_frequencies(c))

    x = params["embed"][tokens]                                          # [B, T, E]

    def layer_step(carry, layer):
        x, k_flat, v_flat, i = carry                                     # k_flat [L*N*bs, K, D]
        x, k_flat, v_flat = decoder_layer(c, layer, x, k_flat, v_flat, i, positions, meta,
                                          inv_freq, kv.k.shape,
                                          attention_backend=attention_backend)
        return (x, k_flat, v_flat, i + 1), None

    k_flat = kv.k.reshape(-1, kvh, d)
    v_flat = kv.v.reshape(-1, kvh, d)
    (x, k_flat, v_flat, _), _ = jax.lax.scan(
        layer_step, (x, k_flat, v_flat, jnp.int32(0)), params["layers"])
    new_kv = KVCache(k_flat.reshape(kv.k.shape), v_flat.reshape(kv.v.shape))

    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]  # [B, E]
    x = rms_norm(x, params["final_norm"], c.rms_norm_eps)
    logits = output_logits(params, c, x)
    return logits, new_kv


def output_logits(params: Params, config: ModelConfig, x: jax.Array) -> jax.Array:
    """x: [..., E] (final-normed) -> logits [..., V] float32 (V / tp on a vocab shard)."""
    if config.tie_word_embeddings:  # contract [V, E] as stored: `embed.T` would copy it
        return jnp.einsum("...e,ve->...v", x, params["embed"],
                          preferred_element_type=jnp.float32)
    return jnp.einsum("...e,ev->...v", x, params["lm_head"], preferred_element_type=jnp.float32)


def init_kv_cache(config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: str | None = None) -> KVCache:
    shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    dt = jnp.dtype(dtype or config.dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))
