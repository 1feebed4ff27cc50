"""The Llama-family decoder (Llama 2/3, Mistral, SmolLM2) as pure functions over a param pytree.

A step is one flat batch of tokens: every row's tokens one after another (a decode row gives
one token, a prefill chunk many), padding at the end.

    tokens [T] -> embed -> scan over layers {
        x += attn(rmsnorm(x))   q,k,v projections; RoPE and the write of k,v into the paged
                                cache at `slot_mapping`, one op (kernels/rope_kv_write.py);
                                paged attention of each token over its row's block table
                                (kernels/attention.py)
        x += mlp(rmsnorm(x))    SwiGLU
    } -> the rows' logits tokens -> rmsnorm -> logits (tied or separate output embedding)

Layers are stacked on a leading `layers` axis; `lax.scan` runs the layer index and every matmul
reads its layer of the stacked weight in place (kernels/matmul.py), so compile time does not
grow with depth and no layer slice is copied.  The KV cache goes in as an argument and comes out
as a return value.

A mixture-of-experts model (Mixtral, Qwen2/Qwen3-MoE: ModelConfig.num_experts > 0) replaces
the SwiGLU by models/moe.py's routed experts; Qwen2's q/k/v biases and Qwen3's per-head q/k
norms are optional parameters of the attention.

Einsum letters: T tokens, R rows, E embed, H query heads, K kv heads, D head dim, F mlp hidden,
V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.attention import attention
from xlaserve.kernels.kv_quant import row_width
from xlaserve.kernels.matmul import (
    PackedWeight,
    head_matmul,
    layer_matmul,
    pack_weight,
)
from xlaserve.kernels.quantized import QuantizedWeight, as_operand, is_quantized, quantize_int8
from xlaserve.kernels.rms_norm import rms_norm
from xlaserve.kernels.rope_kv_write import rope_kv_write
from xlaserve.models.block import attention_out, mlp, queries_keys_values
from xlaserve.models.config import ModelConfig
from xlaserve.models.moe import ONE_DEVICE, ExpertShard, moe_mlp, moe_param_axes, moe_param_shapes
from xlaserve.models.quantize import quantize_params, quantized_axes, quantized_shapes
from xlaserve.models.rope import model_rope_tables

Params = dict[str, Any]


class KVCache(NamedTuple):
    k: jax.Array  # [L, N, bs, K, D] float, or [L, N, bs, K, D + 4] int8 (kernels/kv_quant.py)
    v: jax.Array  # the same


class AttentionMetadata(NamedTuple):
    """Which row each token of the flat batch belongs to and where its KV goes.

    Tokens of one row are consecutive, in row order, with consecutive positions; a token at
    position p attends to its row's cached positions <= p (the step's own KV included).
    Padding tokens have row -1 and write to slot 0, in the reserved null block."""

    block_tables: jax.Array  # [R, W] int32 physical block ids, 0-padded
    token_rows: jax.Array    # [T] int32 row of each token, -1 = padding
    slot_mapping: jax.Array  # [T] int32 block_id * block_size + offset


# Logical axis names of every parameter (see sharding/rules.py).
def param_axes(config: ModelConfig) -> Params:
    layers: Params = {
        "attn_norm": ("layers", "embed"),
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "embed"),
    }
    if config.attention_bias:
        layers.update(bq=("layers", "heads", "head_dim"), bk=("layers", "kv_heads", "head_dim"),
                      bv=("layers", "kv_heads", "head_dim"))
    if config.qk_norm and config.qk_norm_span == "all":   # OLMoE: over all heads at once
        layers.update(q_norm=("layers", "heads", "head_dim"),
                      k_norm=("layers", "kv_heads", "head_dim"))
    elif config.qk_norm:
        layers.update(q_norm=("layers", "head_dim"), k_norm=("layers", "head_dim"))
    if config.post_norms:
        layers.update(attn_post_norm=("layers", "embed"), mlp_post_norm=("layers", "embed"))
    if config.is_moe:
        layers.update(moe_param_axes(config))
    else:
        layers.update(w_gate=("layers", "embed", "mlp"), w_up=("layers", "embed", "mlp"),
                      w_down=("layers", "mlp", "embed"))
    axes: Params = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("embed",)}
    if not config.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return quantized_axes(axes) if config.quantization else axes


KV_AXES = ("layers", "blocks", "block_size", "kv_heads", "head_dim")


def param_shapes(config: ModelConfig) -> Params:
    c = config
    L, E, H, K, D, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                           c.intermediate_size, c.vocab_size)
    layers: Params = {"attn_norm": (L, E), "wq": (L, E, H, D), "wk": (L, E, K, D),
                      "wv": (L, E, K, D), "wo": (L, H, D, E), "mlp_norm": (L, E)}
    if c.attention_bias:
        layers.update(bq=(L, H, D), bk=(L, K, D), bv=(L, K, D))
    if c.qk_norm and c.qk_norm_span == "all":
        layers.update(q_norm=(L, H, D), k_norm=(L, K, D))
    elif c.qk_norm:
        layers.update(q_norm=(L, D), k_norm=(L, D))
    if c.post_norms:
        layers.update(attn_post_norm=(L, E), mlp_post_norm=(L, E))
    if c.is_moe:
        layers.update(moe_param_shapes(c))
    else:
        layers.update(w_gate=(L, E, F), w_up=(L, E, F), w_down=(L, F, E))
    shapes: Params = {"embed": (V, E), "layers": layers, "final_norm": (E,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (E, V)
    return quantized_shapes(shapes) if c.quantization else shapes


def init_params(config: ModelConfig, seed: int = 0, scale: float = 0.02) -> Params:
    """Random parameters (host numpy), for tests and tiny models; with
    `config.quantization`, the same float parameters quantized."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(config.dtype)
    if config.quantization:
        return quantize_params(init_params(config.replace(quantization=None), seed, scale),
                               config.quantization)

    def make(path: tuple[Any, ...], shape: tuple[int, ...]) -> np.ndarray:
        name = path[-1].key
        if name.endswith("norm"):
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            arr = scale * rng.standard_normal(shape)
        return arr.astype(dtype)

    return jax.tree_util.tree_map_with_path(make, param_shapes(config),
                                            is_leaf=lambda x: isinstance(x, tuple))


class CacheGeometry(NamedTuple):
    """The stacked cache's shape, for layers that see it flat ([L*N*bs, K, D])."""

    num_blocks: int
    block_size: int


def _as_matrix(w: Any, inner: int) -> jax.Array | PackedWeight | QuantizedWeight:
    """[L, a, b, c] -> [L, a, b*c] (inner=2) or [L, a*b, c] (inner=1): contiguous, no copy;
    a quantized {"q", "scale"} as a QuantizedWeight of that shape.  A packed weight is a matrix
    already."""
    w = as_operand(w)
    if isinstance(w, PackedWeight):
        return w
    if isinstance(w, QuantizedWeight):
        return w.reshape_matrix(inner)
    if inner == 2:
        return w.reshape(*w.shape[:2], -1)
    return w.reshape(w.shape[0], -1, w.shape[-1])


# Each layer weight as the [L, K, N] matrix its matmul multiplies by (see decoder_layers).
_MATRIX_OF = {"wq": 2, "wk": 2, "wv": 2, "wo": 1, "w_gate": 2, "w_up": 2, "w_down": 2}


def pack_params(params: Params) -> Params:
    """The same parameters with every layer matrix packed into panels for the CPU kernels
    (kernels/matmul.py), and the output head as panels too (`head`: [E, V] as one packed
    matrix; for tied embeddings a second copy of the table, transposed, while `embed` stays for
    the input lookup).  Quantized matrices pack as int8 panels; a quantized model's tied head
    is quantized here (groups along E), so its decode steps stream no float32 matrix.
    One device only: the panels are not laid out for a mesh."""
    layers = dict(params["layers"])
    quantized = is_quantized(layers["wq"])
    for name, inner in _MATRIX_OF.items():   # a MoE model's experts stay unpacked (moe.py)
        if name in layers and not isinstance(layers[name], PackedWeight):
            layers[name] = pack_weight(_as_matrix(layers[name], inner))
    out = {**params, "layers": layers}
    if "head" not in params:
        head = as_operand(params["lm_head"]) if "lm_head" in params else params["embed"].T
        if isinstance(head, QuantizedWeight):          # [E, V] int8, scale [E / 32, V]
            head = QuantizedWeight(head.q[None], head.scale[None])
        elif quantized:
            q = jax.jit(lambda h: quantize_int8(h, 0))(head)
            head = QuantizedWeight(q["q"][None], q["scale"][None])
        else:
            head = head[None]
        out["head"] = pack_weight(head)
        out.pop("lm_head", None)
    return out


def decoder_layers(
    config: ModelConfig,
    layers: Params,             # every layer's weights, stacked (this shard's heads / mlp)
    x: jax.Array,               # [T, E]
    k_flat: jax.Array,          # [L*N*bs, K, D] the whole (local) cache, flattened
    v_flat: jax.Array,          # [L*N*bs, K, D]
    positions: jax.Array,       # [T] int32
    meta: AttentionMetadata,
    geometry: CacheGeometry,
    *,
    attention_backend: str = "auto",
    attend: Callable[..., jax.Array] = attention,
    reduce: Callable[[jax.Array], jax.Array] | None = None,
    experts: ExpertShard = ONE_DEVICE,
    first_layer: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:   # x [T, E], k_flat, v_flat
    """Every layer of `layers` in order, pre-norm: x += attn(norm(x)); x += mlp(norm(x))
    (Gemma: x += norm(attn(norm(x))), the same for the MLP).

    The weights are closed over, not scanned: each layer's matmuls get the stack and the layer
    index (kernels/matmul.py reads the slice in place; the jnp path slices it).  Under tensor
    parallelism (sharding/parallel_forward.py) `layers` holds one shard's heads and mlp slice,
    so the outputs of `wo` and `w_down` are partial sums that `reduce` adds up over the shards
    (None, one device: the residual adds go into those matmuls), and `attend` may stand in for
    `attention` with the same signature.  A MoE model's MLP is models/moe.py's, over the experts
    `experts` names (all of them on one device), its partial sums added by `experts.reduce`.
    Where layers differ in kind (Gemma's sliding and full layers), layer `first_layer + i`
    of the model picks its window and RoPE (a pipeline stage starts at `first_layer`).
    KV writes to slots outside the cache are dropped (pipeline bubbles rely on it)."""
    c = config
    t = x.shape[0]
    kvh, d = k_flat.shape[1], c.head_dim   # an int8 cache's rows are d + 4 bytes wide
    layers = jax.tree_util.tree_map(jnp.asarray, layers)   # host arrays, outside jit
    use_kernel = attention_backend_uses_kernels(attention_backend)
    tables = model_rope_tables(c, positions)                            # kind -> [T, D/2] x 2
    wq, wk, wv = (_as_matrix(layers[n], 2) for n in ("wq", "wk", "wv"))  # [L, E, heads*D]
    wo = _as_matrix(layers["wo"], 1)                                      # [L, H*D, E]
    w_mlp = () if c.is_moe else tuple(_as_matrix(layers[n], 2) for n in ("w_gate", "w_up",
                                                                          "w_down"))
    heads = wq.shape[-1] // d
    per_layer = geometry.num_blocks * geometry.block_size
    # The tokens up to the last real one (the flat batch is padded at its end): the CPU
    # matmuls on packed panels skip the padding's rows.  None elsewhere: every row computed.
    used = None
    if use_kernel and isinstance(wq, PackedWeight):
        used = jnp.max(jnp.where(meta.token_rows >= 0, jnp.arange(1, t + 1, dtype=jnp.int32), 0))
    sliding = jnp.asarray([k == "sliding" for k in c.layer_kinds or ()], bool)   # [L model]

    def attend_as(window: int | None) -> Callable[..., jax.Array]:
        def run(q: jax.Array, k_flat: jax.Array, v_flat: jax.Array, i: jax.Array) -> jax.Array:
            return attend(q, k_flat, v_flat, i, meta.token_rows, positions, meta.block_tables,
                          num_blocks=geometry.num_blocks, block_size=geometry.block_size,
                          scale=c.attention_scale or d ** -0.5, soft_cap=c.attn_soft_cap,
                          sliding_window=window, backend=attention_backend)   # [T, H, D]
        return run

    def layer_step(carry: tuple[jax.Array, ...], i: jax.Array) -> tuple[tuple[jax.Array, ...],
                                                                      None]:
        x, k_flat, v_flat = carry
        q, k, v = queries_keys_values(c, layers, (wq, wk, wv), i, x, (heads, kvh, d),
                                       use_kernel, used)
        local = sliding[first_layer + i] if c.mixed_layers else None   # this layer's kind
        cos, sin = _layer_rope(tables, local, c.layer_kinds)
        q, k_flat, v_flat = rope_kv_write(q, k, v, cos, sin, k_flat, v_flat, i,
                                          meta.slot_mapping, rows_per_layer=per_layer,
                                          use_kernel=use_kernel)
        attn = attend_as(c.layer_windows[0])(q, k_flat, v_flat, i) if local is None else \
            jax.lax.cond(local, attend_as(c.sliding_window), attend_as(None), q, k_flat, v_flat, i)
        x = attention_out(c, layers, wo, i, attn.reshape(t, heads * d), x, reduce,
                           use_kernel, used)
        if c.is_moe:
            h = rms_norm(x, layers["mlp_norm"][i], c.rms_norm_eps)
            return (x + moe_mlp(c, layers, i, h, experts), k_flat, v_flat), None
        return (mlp(c, layers, w_mlp, i, x, reduce, use_kernel, used), k_flat, v_flat), None

    num_layers = wq.shape[0]
    (x, k_flat, v_flat), _ = jax.lax.scan(layer_step, (x, k_flat, v_flat),
                                          jnp.arange(num_layers, dtype=jnp.int32))
    return x, k_flat, v_flat


def _layer_rope(tables: dict[str, tuple[jax.Array, jax.Array]], sliding: jax.Array | None,
                kinds: tuple[str, ...] | None) -> tuple[jax.Array, jax.Array]:   # [T, D/2] x 2
    """The RoPE of a layer: the full layers' table, or where the sliding layers have one of
    their own (Gemma 3), that one for a sliding layer: `sliding` (a traced bool) in a model
    of mixed layers, else every layer's one kind (`kinds`)."""
    if sliding is None:
        return tables.get((kinds or ("full",))[0], tables["full"])
    if "sliding" not in tables:
        return tables["full"]
    cos, sin = (jnp.where(sliding, a, b) for a, b in zip(tables["sliding"], tables["full"]))
    return cos, sin


def attention_backend_uses_kernels(backend: str) -> bool:
    """Do the weight matmuls go through the native kernels (the `cpu` backend) or jnp?"""
    from xlaserve.kernels.attention import resolve_backend

    return resolve_backend(backend) == "cpu"


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,       # [T] int32
    positions: jax.Array,    # [T] int32
    kv: KVCache,
    meta: AttentionMetadata,
    *,
    logits_index: jax.Array | None = None,  # [R] int32: one token per row, or None for all
    attention_backend: str = "auto",
) -> tuple[jax.Array, KVCache]:             # logits [R, V] or [T, V] float32; new cache
    c = config
    _, num_blocks, block_size, kvh, d = kv.k.shape
    x = scale_embeddings(c, params["embed"][tokens])                     # [T, E]
    x, k_flat, v_flat = decoder_layers(
        c, params["layers"], x, kv.k.reshape(-1, kvh, d), kv.v.reshape(-1, kvh, d), positions,
        meta, CacheGeometry(num_blocks, block_size), attention_backend=attention_backend)
    new_kv = KVCache(k_flat.reshape(kv.k.shape), v_flat.reshape(kv.v.shape))
    if logits_index is not None:
        x = x[logits_index]                                              # [R, E]
    return final_logits(params, c, x, attention_backend), new_kv


def scale_embeddings(config: ModelConfig, x: jax.Array) -> jax.Array:
    """The looked-up embeddings [T, E] times the family's multiplier (Gemma sqrt(E), rounded
    to x's dtype as transformers does; Granite's embedding_multiplier)."""
    return x if config.embed_scale == 1.0 else x * jnp.asarray(config.embed_scale, x.dtype)


def final_logits(params: Params, config: ModelConfig, hidden: jax.Array,
                 attention_backend: str = "auto") -> jax.Array:
    """The last hidden states [M, E] -> final norm -> logits [M, V] float32 (V / tp on a vocab
    shard): the head of every forward, on one device or a mesh."""
    x = rms_norm(hidden, params["final_norm"], config.rms_norm_eps)
    logits = output_logits(params, config, x,
                           use_kernel=attention_backend_uses_kernels(attention_backend))
    if config.logits_divisor != 1.0:     # Granite
        logits = logits / config.logits_divisor
    if config.final_soft_cap is not None:   # Gemma 2
        cap = config.final_soft_cap
        logits = cap * jnp.tanh(logits / cap)
    return logits


def output_logits(params: Params, config: ModelConfig, x: jax.Array, *,
                  use_kernel: bool = False) -> jax.Array:
    """x: [M, E] (final-normed) -> logits [M, V] float32 (V / tp on a vocab shard)."""
    if "head" in params:   # packed panels (pack_params)
        (logits,) = layer_matmul(x, (params["head"],), jnp.int32(0), use_kernel=use_kernel)
        return logits.astype(jnp.float32)
    if config.tie_word_embeddings:  # contract [V, E] as stored: `embed.T` would copy it
        return head_matmul(x, params["embed"], use_kernel=use_kernel)
    head = as_operand(params["lm_head"])                                 # [E, V]
    if isinstance(head, QuantizedWeight):
        return head.matmul_reference(x, jnp.int32(0)).astype(jnp.float32)
    if use_kernel and x.dtype == jnp.float32:
        (logits,) = layer_matmul(x, (head,), jnp.int32(0))
        return logits
    return jnp.einsum("me,ev->mv", x, head, preferred_element_type=jnp.float32)


def kv_shape(config: ModelConfig, num_blocks: int, block_size: int,
             dtype: str | None = None) -> tuple[int, ...]:
    """[L, N, bs, K, D], or D + 4 for an int8 cache (kernels/kv_quant.py)."""
    return (config.num_layers, num_blocks, block_size, config.num_kv_heads,
            row_width(config.head_dim, dtype or config.dtype))


def init_kv_cache(config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: str | None = None) -> KVCache:
    shape = kv_shape(config, num_blocks, block_size, dtype)
    dt = jnp.dtype(dtype or config.dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))
