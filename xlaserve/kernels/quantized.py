"""Weight-only int8 (and fp8) quantization in groups along the contraction axis.

    quantize_int8(w, axis, group) -> {"q": int8 like w, "scale": float32 like w with
                                      w.shape[axis] / group at `axis`}
        every run of `group` consecutive elements along `axis` (for each index of the other
        axes) shares one scale = max |w| over the run / 127 (1 for an all-zero run);
        q = round(w / scale) in [-127, 127]
    quantize_fp8(w, axis, group)  the same groups and scales with 448 (e4m3's largest finite
        value) for 127: q = float8_e4m3fn(w / scale), rounded to nearest (3 mantissa bits)
    QuantizedWeight(q, scale)     the in-graph view of such a pair, as one matmul operand:
        q [L, K, N] int8 or float8_e4m3fn, scale [L, K / G, N] float32;
        w[l, k, n] = q[l, k, n] * scale[l, k//G, n]

fp8 is a GPU format (H100/H200 read e4m3 natively): it shares the int8 layout, pytree,
checkpoints and shardings, and runs the jnp path, which dequantizes into the dot.  XLA:CPU has
no fast fp8 arithmetic and the CPU kernels read int8 panels only, so fp8 on the CPU backend is
refused (`check_fp8_platform`) unless XLASERVE_FP8_ON_CPU=1, a test-only override that runs
the jnp path for correctness.

Groups of 32 along K keep SmolLM2's teacher-forced top-1 agreement with float32 at ~99%
(per output channel, one scale per column: ~96%; BENCHMARKS.md, "int8 weights"), for one
float of scales per 32 weights (12.5% over the int8 bytes); they are also GGUF Q8_0's blocks.

In the parameter pytree (and so in checkpoints and sharding specs) a quantized matrix is the
plain dict {"q", "scale"}: orbax, the layout rules and shard_map see two arrays of the same
rank and logical axes, so a scale is sharded like the weights it scales.  The model wraps the
dict as a `QuantizedWeight` where it multiplies (`as_operand`).  The CPU kernels read q and the
scales where they lie, packed (kernels/cpu/native/matmul_packed.cc); the jnp path dequantizes
into the dot.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

QMAX = 127
FP8_MAX = 448.0     # the largest finite float8_e4m3fn
GROUP = 32      # weights per scale, along the contraction axis
FP8_DTYPE = jnp.float8_e4m3fn
# Test-only: lets the jnp path run fp8 on the CPU backend (correctness, not speed).
FP8_ON_CPU_ENV = "XLASERVE_FP8_ON_CPU"


def is_fp8(dtype: Any) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(FP8_DTYPE)


def check_fp8_platform(option: str, platform: str | None = None) -> None:
    """Refuse fp8 (named by `option`, e.g. "quantization='fp8'") on the CPU backend: XLA:CPU
    emulates fp8 arithmetic elementwise and the CPU kernels do not read it.  `platform`: the
    devices' (default: jax's default backend)."""
    platform = platform or jax.default_backend()
    if platform == "cpu" and os.environ.get(FP8_ON_CPU_ENV) != "1":
        raise ValueError(f"{option} is a GPU option: XLA:CPU cannot run fp8 (float8_e4m3fn) "
                         f"dots fast and the CPU kernels read int8 only; use 'int8' on CPU "
                         f"({FP8_ON_CPU_ENV}=1 runs fp8 through the jnp path for tests)")


def is_quantized(w: Any) -> bool:
    """Is `w` a quantized matrix as the parameter pytree holds it ({"q", "scale"})?"""
    return isinstance(w, dict) and set(w) == {"q", "scale"}


def scale_shape(shape: tuple[int, ...], axis: int, group: int = GROUP) -> tuple[int, ...]:
    """The scale's shape for a weight of `shape` grouped along `axis`."""
    axis %= len(shape)
    if shape[axis] % group:
        raise ValueError(f"int8 / fp8 quantization: axis {axis} of a weight {shape} has "
                         f"{shape[axis]} elements, not a multiple of the group size {group}")
    return (*shape[:axis], shape[axis] // group, *shape[axis + 1:])


def quantize_int8(w: Any, axis: int, group: int = GROUP) -> dict[str, Any]:
    """w (numpy or jax, any float dtype) -> {"q", "scale"} (see the module docstring).  Numpy
    in, numpy out (conversion on the host); jax in, jax out (under jit, on its devices)."""
    xp = jnp if isinstance(w, jax.Array) else np
    axis %= w.ndim
    groups = scale_shape(w.shape, axis, group)
    runs = (*groups[:axis + 1], group, *groups[axis + 1:])     # the axis split in two
    wf = w.astype(xp.float32).reshape(runs)
    amax = xp.max(xp.abs(wf), axis=axis + 1, keepdims=True)
    scale = xp.where(amax > 0, amax / QMAX, 1.0).astype(xp.float32)
    q = xp.clip(xp.round(wf / scale), -QMAX, QMAX).astype(xp.int8)
    return {"q": q.reshape(w.shape), "scale": xp.squeeze(scale, axis=axis + 1)}


def quantize_fp8(w: Any, axis: int, group: int = GROUP) -> dict[str, Any]:
    """w -> {"q": float8_e4m3fn like w, "scale": float32} in quantize_int8's groups, each
    scale = max |w| over its run / 448 (1 for an all-zero run).  Numpy in, numpy out (the
    cast rounds to nearest even, ml_dtypes); jax in, jax out."""
    xp = jnp if isinstance(w, jax.Array) else np
    axis %= w.ndim
    groups = scale_shape(w.shape, axis, group)
    runs = (*groups[:axis + 1], group, *groups[axis + 1:])
    wf = w.astype(xp.float32).reshape(runs)
    amax = xp.max(xp.abs(wf), axis=axis + 1, keepdims=True)
    scale = xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(xp.float32)
    # e4m3fn has no infinity: a value past 448 would cast to NaN, so clip first
    q = xp.clip(wf / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return {"q": q.reshape(w.shape), "scale": xp.squeeze(scale, axis=axis + 1)}


QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8}


def dequantize(w: dict[str, Any], axis: int) -> Any:
    """The float32 weight a quantized pair stands for (tests, the quality benchmark)."""
    q, s = w["q"], w["scale"]
    xp = jnp if isinstance(q, jax.Array) else np
    axis %= q.ndim
    group = q.shape[axis] // s.shape[axis]
    return (q.astype(xp.float32) * xp.repeat(s, group, axis=axis)).astype(xp.float32)


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    """A stacked int8 (or fp8) matrix and its group scales: q [L, K, N] (or [K, N]) int8 or
    float8_e4m3fn, scale [L, K / G, N] (or [K / G, N]) float32."""

    def __init__(self, q: jax.Array, scale: jax.Array):
        self.q = q
        self.scale = scale

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def dtype(self) -> Any:   # its scales' (float32); it computes in its input's dtype
        return self.scale.dtype

    @property
    def group(self) -> int:
        return self.q.shape[-2] // self.scale.shape[-2]

    def reshape_matrix(self, inner: int) -> QuantizedWeight:
        """[L, a, b, c] -> [L, a, b*c] (inner=2, contracted over a) or [L, a*b, c] (inner=1,
        contracted over a, b, grouped along b): q and scale alike, no copy."""
        q, s = self.q, self.scale
        if inner == 2:
            return QuantizedWeight(q.reshape(*q.shape[:2], -1), s.reshape(*s.shape[:2], -1))
        return QuantizedWeight(q.reshape(q.shape[0], -1, q.shape[-1]),
                               s.reshape(s.shape[0], -1, s.shape[-1]))

    def dequantized(self) -> jax.Array:
        """The weight it stands for, [L, K, N] (or [K, N]), float32."""
        return dequantize({"q": self.q, "scale": self.scale}, -2)

    def matmul_reference(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        """x [M, K] @ w[layer] -> [M, N]."""
        if is_fp8(self.q.dtype):
            check_fp8_platform("quantization='fp8'")
        q, s = (self.q[layer], self.scale[layer]) if self.ndim == 3 else (self.q, self.scale)
        return x @ QuantizedWeight(q, s).dequantized().astype(x.dtype)

    def tree_flatten(self) -> tuple[tuple[jax.Array, jax.Array], None]:
        return (self.q, self.scale), None

    @classmethod
    def tree_unflatten(cls, _: None, children: tuple[jax.Array, jax.Array]) -> QuantizedWeight:
        return cls(*children)


def as_operand(w: Any) -> Any:
    """A parameter-tree matrix as a matmul operand: {"q", "scale"} -> QuantizedWeight; an
    array (or an already packed weight) as it is."""
    return QuantizedWeight(w["q"], w["scale"]) if is_quantized(w) else w
