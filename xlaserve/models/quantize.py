"""Which parameters of the decoder are quantized, over which axes, and how the pytree changes.

    ModelConfig.quantization = "int8"  (None: every parameter in ModelConfig.dtype)
      every layer matrix (and an untied lm_head) w -> {"q": int8 like w, "scale": float32}
      (kernels/quantized.py: one scale per 32 weights along GROUP_AXIS[name], the contraction
      axis, or its innermost part for wo);
      norms and the embedding table stay float (the table is gathered, not streamed; the CPU
      backend quantizes its packed copy of a tied output head at load, models/llama.pack_params)
    ModelConfig.quantization = "fp8"   the same matrices and groups with q float8_e4m3fn
      (scale = max |w| / 448): a GPU option, refused on the CPU backend (kernels/quantized.py)

The same map changes shapes, logical axes and dtypes (`quantized_tree`), so checkpoints,
layouts and shardings follow the quantized pytree with no special case: a scale has its
weight's rank and logical axes and is sharded like the weights it scales (wo's groups run along
head_dim, so a head's scales stay with the head on its tensor shard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

QUANTIZATIONS = (None, "int8", "fp8")
# What each quantization stores its q in (its scales are float32).
Q_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}
# The KV cache dtypes served by name (engine kv_cache_dtype, bench --kv-cache-dtype) that are
# not jax dtype names: fp8 rows are float8_e4m3fn with their scale inside (kernels/kv_quant.py).
KV_CACHE_ALIASES = {"fp8": "float8_e4m3fn"}
# Every KV cache dtype served: float32 (SmolLM2's), the 16-bit floats, and the quantized rows
# of kernels/kv_quant.py ("fp8" is a GPU option).
KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8")

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


def quantize_params(params: dict[str, Any], mode: str = "int8") -> dict[str, Any]:
    """Float parameters -> `mode` ("int8" | "fp8") ones (numpy in, numpy out; jax arrays under
    jit stay on their devices).  Already quantized entries are left as they are."""
    from xlaserve.kernels.quantized import QUANTIZERS  # jax: this module stays free of it

    if mode not in QUANTIZERS:
        raise ValueError(f"quantize_params: mode={mode!r}, choose from {sorted(QUANTIZERS)}")
    quantize = QUANTIZERS[mode]
    return quantized_tree(
        params, lambda w, c: w if isinstance(w, dict) else quantize(w, c))


def kv_cache_dtype_name(name: str) -> str:
    """A served KV cache dtype ("fp8", "int8", "float32", ...) as a jax dtype name."""
    return KV_CACHE_ALIASES.get(name, name)


def leaf_dtype(path: tuple[Any, ...], dtype: str, quantization: str | None = "int8") -> str:
    """The dtype of the parameter at `path` (a jax key path): `quantization`'s for a quantized
    q (int8, float8_e4m3fn), float32 for its scale, `dtype` for everything else."""
    name = getattr(path[-1], "key", None)
    parent = getattr(path[-2], "key", None) if len(path) > 1 else None
    if parent in GROUP_AXIS or parent == "lm_head":
        q = Q_DTYPES[quantization or "int8"]
        return {"q": q, "scale": "float32"}.get(name, dtype)
    return dtype
