"""HF tensor layout -> xlaserve parameter pytree.

Both converters reduce their input to Hugging Face Llama tensor names and layouts
(`model.layers.{i}.self_attn.q_proj.weight` as [out, in], ...), then build the stacked pytree here:

    q_proj [H*D, E]  -> wq [L, E, H, D]      o_proj    [E, H*D] -> wo     [L, H, D, E]
    k_proj [K*D, E]  -> wk [L, E, K, D]      gate/up   [F, E]   -> w_*    [L, E, F]
    v_proj [K*D, E]  -> wv [L, E, K, D]      down_proj [E, F]   -> w_down [L, F, E]

A mixture-of-experts layer (models/moe.py) instead of gate/up/down, each expert j's matrices
stacked on the experts axis (Mixtral's names; Qwen2/Qwen3-MoE's in brackets):

    block_sparse_moe.gate [X, E]           (mlp.gate)                 -> router  [L, E, X]
    ...experts.{j}.w1 [F, E]               (mlp.experts.{j}.gate_proj) -> we_gate [L, X, E, F]
    ...experts.{j}.w3 [F, E]               (...up_proj)                -> we_up   [L, X, E, F]
    ...experts.{j}.w2 [E, F]               (...down_proj)              -> we_down [L, X, F, E]
    (mlp.shared_expert.{gate,up,down}_proj, shared_expert_gate [1, E]) -> ws_*, ws_router [L, E]
    (self_attn.{q,k,v}_proj.bias [H*D | K*D]) -> bq [L, H, D], bk, bv [L, K, D]
    (self_attn.{q,k}_norm [D])                -> q_norm, k_norm [L, D]
    (OLMoE: self_attn.{q,k}_norm [H*D | K*D])  -> q_norm [L, H, D], k_norm [L, K, D]

Matrices already int8 in the source (`get_int8`: GGUF Q8_0, q [out, in] and a float32 scale
per 32 weights of a row, [out, in / 32]) can come across as they are, as {"q", "scale"} in
models/quantize.py's layout: q moves like the float weight, the scale the same way with the
contracted axis counted in groups (wq: [H*D, E/32] -> [E/32, H, D]; wo: [E, H*D/32] ->
[H, D/32, E], a head's groups along its own D).  A stack is int8 only if every layer's tensor
is; a stack with any other type in it is read as float (and quantized afterwards by the
converter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import numpy as np

from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params, param_shapes
from xlaserve.models.quantize import GROUP_AXIS

log = logging.getLogger(__name__)

GetTensor = Callable[[str], np.ndarray]
# HF name -> (q [out, in] int8, scale [out, in / 32] float32), or None where the source does
# not store that tensor as int8 groups of 32 along `in`.
GetInt8 = Callable[[str], "tuple[np.ndarray, np.ndarray] | None"]

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


_MIXTRAL_EXPERTS = {
    "router": "block_sparse_moe.gate.weight",
    "we_gate": "block_sparse_moe.experts.{j}.w1.weight",
    "we_up": "block_sparse_moe.experts.{j}.w3.weight",
    "we_down": "block_sparse_moe.experts.{j}.w2.weight",
}
_QWEN_EXPERTS = {
    "router": "mlp.gate.weight",
    "we_gate": "mlp.experts.{j}.gate_proj.weight",
    "we_up": "mlp.experts.{j}.up_proj.weight",
    "we_down": "mlp.experts.{j}.down_proj.weight",
    "ws_gate": "mlp.shared_expert.gate_proj.weight",
    "ws_up": "mlp.shared_expert.up_proj.weight",
    "ws_down": "mlp.shared_expert.down_proj.weight",
    "ws_router": "mlp.shared_expert_gate.weight",
}
_ATTENTION_EXTRAS = {
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}


# Gemma 2/3: four norms a layer (post_attention_layernorm is the attention output's there).
_POST_NORMS = {
    "attn_post_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "mlp_post_norm": "post_feedforward_layernorm.weight",
}


def layer_tensors(config: ModelConfig) -> dict[str, str]:
    """Our layer parameter name -> its HF tensor name inside `model.layers.{i}.` ({j}: the
    expert, for the stacked expert weights)."""
    ours = param_shapes(config)["layers"]
    table = {**_LAYER_TENSORS, **_ATTENTION_EXTRAS,
             **(_MIXTRAL_EXPERTS if config.architecture == "mixtral" else _QWEN_EXPERTS),
             **(_POST_NORMS if config.post_norms else {})}
    return {name: table[name] for name in ours}


def _to_ours(name: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    e, d = c.hidden_size, c.head_dim
    if name == "wq":
        return w.T.reshape(e, c.num_heads, d)
    if name in ("wk", "wv"):
        return w.T.reshape(e, c.num_kv_heads, d)
    if name == "wo":
        return w.T.reshape(c.num_heads, d, e)
    if name in ("w_gate", "w_up", "w_down", "router", "we_gate", "we_up", "we_down", "ws_gate",
                "ws_up", "ws_down"):
        return w.T
    if name == "ws_router":                        # [1, E]
        return w.reshape(e)
    if name == "bq":
        return w.reshape(c.num_heads, d)
    if name in ("bk", "bv"):
        return w.reshape(c.num_kv_heads, d)
    if c.qk_norm_span == "all" and name in ("q_norm", "k_norm"):   # OLMoE: [H*D], [K*D]
        return w.reshape(c.num_heads if name == "q_norm" else c.num_kv_heads, d)
    return w


def _int8_to_ours(name: str, q: np.ndarray, scale: np.ndarray, c: ModelConfig
                  ) -> dict[str, np.ndarray]:
    """An HF-layout int8 matrix (q [out, in], scale [out, in / 32]) -> {"q", "scale"} in our
    layout (see the module docstring): q as _to_ours moves a float weight, the scale alike."""
    ours_q = _to_ours(name, q, c)
    if name in ("wq", "wk", "wv"):                 # [E/32, heads*D] -> [E/32, heads, D]
        ours_s = scale.T.reshape(-1, *ours_q.shape[1:])
    elif name == "wo":                             # [H*D/32, E] -> [H, D/32, E]
        ours_s = scale.T.reshape(c.num_heads, -1, c.hidden_size)
    else:                                          # [in/32, out]
        ours_s = scale.T
    return {"q": ours_q, "scale": np.ascontiguousarray(ours_s, np.float32)}


def _int8_matrices(config: ModelConfig, get_int8: GetInt8, shapes: Params) -> Params:
    """The layer stacks (and lm_head) whose every tensor `get_int8` returns, as {"q", "scale"}
    stacks; the others are left out (read as float)."""
    from xlaserve.models.quantize import quantized_shapes

    want = quantized_shapes(shapes)
    out: Params = {"layers": {}}
    for ours, suffix in layer_tensors(config).items():
        if ours not in GROUP_AXIS:
            continue
        stack = []
        for i in range(config.num_layers):
            got = get_int8(f"model.layers.{i}.{suffix}")
            if got is None:
                break
            stack.append(_int8_to_ours(ours, *got, config))
        if len(stack) == config.num_layers:
            out["layers"][ours] = {k: np.stack([s[k] for s in stack]) for k in ("q", "scale")}
    if not config.tie_word_embeddings:
        got = get_int8("lm_head.weight")            # [V, E], scale [V, E/32]
        if got is not None:
            out["lm_head"] = {"q": np.ascontiguousarray(got[0].T),
                              "scale": np.ascontiguousarray(got[1].T, np.float32)}
    for name, w in [*out["layers"].items(), *([("lm_head", out["lm_head"])]
                                              if "lm_head" in out else [])]:
        shape = want["layers"][name] if name in want["layers"] else want[name]
        got_shapes = {k: tuple(w[k].shape) for k in ("q", "scale")}
        if got_shapes != {k: tuple(shape[k]) for k in ("q", "scale")}:
            raise CheckpointError(f"int8 tensor {name}: shapes {got_shapes} do not match the "
                                  f"config (expected {shape} after layout change)")
    return out


def params_from_hf(config: ModelConfig, get: GetTensor,
                   progress: Callable[[Iterable[int]], Iterable[int]] = iter,
                   get_int8: GetInt8 | None = None) -> Params:
    """Build the stacked parameter pytree (host numpy, config dtype) from HF-named tensors.
    With `get_int8`, the matrices the source stores as int8 come back as {"q", "scale"}
    stacks without a float round trip (module docstring); everything else is float."""
    shapes = param_shapes(config)
    int8 = _int8_matrices(config, get_int8, shapes) if get_int8 else {"layers": {}}
    if get_int8:
        stored = [*int8["layers"], *(["lm_head"] if "lm_head" in int8 else [])]
        matrices = [n for n in [*GROUP_AXIS, "lm_head"] if n in shapes["layers"] or n in shapes]
        log.info("matrices read as the int8 they are stored in: %s; read as float: %s",
                 ", ".join(stored) or "none",
                 ", ".join(n for n in matrices if n not in stored) or "none")

    def fetch(name: str, shape: tuple[int, ...], our_name: str) -> np.ndarray:
        w = _to_ours(our_name, np.asarray(get(name), dtype=np.float32), config)
        if w.shape != tuple(shape):
            raise CheckpointError(f"tensor {name}: shape {w.shape} does not match the config "
                                  f"(expected {tuple(shape)} after layout change)")
        return w

    params: Params = {
        "embed": fetch("model.embed_tokens.weight", shapes["embed"], "embed"),
        "final_norm": fetch("model.norm.weight", shapes["final_norm"], "final_norm"),
        "layers": {k: np.empty(s, np.float32) for k, s in shapes["layers"].items()
                   if k not in int8["layers"]},
    }
    if "lm_head" in int8:
        params["lm_head"] = int8["lm_head"]
    elif not config.tie_word_embeddings:
        params["lm_head"] = fetch("lm_head.weight", shapes["lm_head"][::-1], "lm_head").T
    for i in progress(range(config.num_layers)):
        for ours, suffix in layer_tensors(config).items():
            if ours in int8["layers"]:
                continue
            shape = shapes["layers"][ours][1:]
            if ours.startswith("we_"):             # one HF tensor per expert
                for j in range(config.num_experts):
                    params["layers"][ours][i, j] = fetch(
                        f"model.layers.{i}.{suffix.format(j=j)}", shape[1:], ours)
            else:
                params["layers"][ours][i] = fetch(f"model.layers.{i}.{suffix}", shape, ours)
    params["layers"].update(int8["layers"])
    return params if config.dtype == "float32" else _cast(params, config.dtype)


def _cast(params: Params, dtype: str) -> Params:
    """Float leaves to `dtype`; int8 matrices ({"q", "scale"}) as they are."""
    import jax
    import jax.numpy as jnp

    from xlaserve.kernels.quantized import is_quantized

    return jax.tree_util.tree_map(
        lambda a: a if is_quantized(a) else np.asarray(a).astype(jnp.dtype(dtype)), params,
        is_leaf=is_quantized)
