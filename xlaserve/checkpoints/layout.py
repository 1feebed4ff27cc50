"""HF tensor layout -> xlaserve parameter pytree.

Both converters reduce their input to Hugging Face Llama tensor names and layouts
(`model.layers.{i}.self_attn.q_proj.weight` as [out, in], ...), then build the stacked pytree here:

    q_proj [H*D, E]  -> wq [L, E, H, D]      o_proj    [E, H*D] -> wo     [L, H, D, E]
    k_proj [K*D, E]  -> wk [L, E, K, D]      gate/up   [F, E]   -> w_*    [L, E, F]
    v_proj [K*D, E]  -> wv [L, E, K, D]      down_proj [E, F]   -> w_down [L, F, E]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params, param_shapes

GetTensor = Callable[[str], np.ndarray]

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def hf_tensor_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{suffix}" for suffix in _LAYER_TENSORS.values()]
    return names


def _to_ours(name: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    e, d = c.hidden_size, c.head_dim
    if name == "wq":
        return w.T.reshape(e, c.num_heads, d)
    if name in ("wk", "wv"):
        return w.T.reshape(e, c.num_kv_heads, d)
    if name == "wo":
        return w.T.reshape(c.num_heads, d, e)
    if name in ("w_gate", "w_up", "w_down"):
        return w.T
    return w


def params_from_hf(config: ModelConfig, get: GetTensor,
                   progress: Callable[[Iterable[int]], Iterable[int]] = iter) -> Params:
    """Build the stacked parameter pytree (host numpy, config dtype) from HF-named tensors."""
    dtype = np.dtype("float32") if config.dtype == "float32" else None
    shapes = param_shapes(config)

    def fetch(name: str, shape: tuple[int, ...], our_name: str) -> np.ndarray:
        w = _to_ours(our_name, np.asarray(get(name), dtype=np.float32), config)
        if w.shape != tuple(shape):
            raise CheckpointError(f"tensor {name}: shape {w.shape} does not match the config "
                                  f"(expected {tuple(shape)} after layout change)")
        return w

    params: Params = {
        "embed": fetch("model.embed_tokens.weight", shapes["embed"], "embed"),
        "final_norm": fetch("model.norm.weight", shapes["final_norm"], "final_norm"),
        "layers": {k: np.empty(s, np.float32) for k, s in shapes["layers"].items()},
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = fetch("lm_head.weight", shapes["lm_head"][::-1], "lm_head").T
    for i in progress(range(config.num_layers)):
        for ours, suffix in _LAYER_TENSORS.items():
            params["layers"][ours][i] = fetch(f"model.layers.{i}.{suffix}",
                                              shapes["layers"][ours][1:], ours)
    return _cast(params, config.dtype) if dtype is None else params


def _cast(params: Params, dtype: str) -> Params:
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda a: np.asarray(a).astype(jnp.dtype(dtype)), params)
