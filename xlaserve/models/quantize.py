"""Which parameters of the decoder are quantized, over which axes, and how the pytree changes.

    ModelConfig.quantization = "int8"  (None: every parameter in ModelConfig.dtype)
      every layer matrix (and an untied lm_head) w -> {"q": int8 like w, "scale": float32}
      (kernels/quantized.py: one scale per 32 weights along GROUP_AXIS[name], the contraction
      axis, or its innermost part for wo);
      norms and the embedding table stay float (the table is gathered, not streamed; the CPU
      backend quantizes its packed copy of a tied output head at load, models/llama.pack_params)

The same map changes shapes, logical axes and dtypes (`quantized_tree`), so checkpoints,
layouts and shardings follow the quantized pytree with no special case: a scale has its
weight's rank and logical axes and is sharded like the weights it scales (wo's groups run along
head_dim, so a head's scales stay with the head on its tensor shard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

QUANTIZATIONS = (None, "int8")

# The axis each quantizable matrix is grouped along (as stored, models/llama.param_shapes).
GROUP_AXIS: dict[str, int] = {
    "wq": 1, "wk": 1, "wv": 1,   # [L, E, heads, D]: contract E
    "wo": 2,                     # [L, H, D, E]: contract H and D, grouped along D
    "w_gate": 1, "w_up": 1,      # [L, E, F]
    "w_down": 1,                 # [L, F, E]
}
LM_HEAD_AXIS = 0                 # [E, V]


def check_quantization(value: Any, where: str) -> None:
    if value not in QUANTIZATIONS:
        raise ValueError(f"{where}={value!r}: choose from "
                         f"{[q for q in QUANTIZATIONS if q]} (or leave it unset for float)")


def quantized_tree(tree: dict[str, Any], of_matrix: Callable[[Any, int], Any]
                   ) -> dict[str, Any]:
    """`tree` (a pytree shaped like the parameters: arrays, shapes, axes...) with every
    quantizable entry m replaced by of_matrix(m, the axis it is grouped along)."""
    layers = {n: of_matrix(v, GROUP_AXIS[n]) if n in GROUP_AXIS else v
              for n, v in tree["layers"].items()}
    out = {**tree, "layers": layers}
    if "lm_head" in tree:
        out["lm_head"] = of_matrix(tree["lm_head"], LM_HEAD_AXIS)
    return out


def quantized_shapes(shapes: dict[str, Any]) -> dict[str, Any]:
    from xlaserve.kernels.quantized import scale_shape

    return quantized_tree(shapes, lambda s, axis: {"q": s, "scale": scale_shape(s, axis)})


def quantized_axes(axes: dict[str, Any]) -> dict[str, Any]:
    return quantized_tree(axes, lambda a, _: {"q": a, "scale": a})


def quantize_params(params: dict[str, Any]) -> dict[str, Any]:
    """Float parameters -> int8 ones (numpy in, numpy out; jax arrays under jit stay on
    their devices).  Already quantized entries are left as they are."""
    from xlaserve.kernels.quantized import quantize_int8  # jax: this module stays free of it

    return quantized_tree(
        params, lambda w, c: w if isinstance(w, dict) else quantize_int8(w, c))


def leaf_dtype(path: tuple[Any, ...], dtype: str) -> str:
    """The dtype of the parameter at `path` (a jax key path): int8 for a quantized q, float32
    for its scale, `dtype` for everything else."""
    name = getattr(path[-1], "key", None)
    parent = getattr(path[-2], "key", None) if len(path) > 1 else None
    if parent in GROUP_AXIS or parent == "lm_head":
        return {"q": "int8", "scale": "float32"}.get(name, dtype)
    return dtype
