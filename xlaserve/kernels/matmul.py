"""Weight matmuls of the decoder: activations times one layer of a stacked weight, read in place.

    layer_matmul(x [M, K], (w_1 [L, K, N_1], ...), layer) -> (x @ w_1[layer], ...)
        norm=(g [L, K], eps): rms_norm(x, g[layer], eps) @ w_1[layer], ... (the pre-norm in
        the same call)
    gated_matmul(gate [M, F], up [M, F], w [L, F, N], layer) -> (silu(gate) * up) @ w[layer]
    head_matmul(x [M, E], table [V, E])                  -> x @ table.T  (tied output head)

Three faces per op: the native CPU kernel (`kernels/cpu/native/matmul.cc`, through XLA's FFI),
the checked wrapper (`layer_matmul`, `head_matmul`, which pick the kernel or the jnp path), and
the jnp reference (`*_reference`, which defines the semantics).

A weight may also come packed (`PackedWeight`, made once at load by `pack_weight`): its
columns cut into panels of TILE_N, each stored as one contiguous [K, TILE_N] run, so that the
kernel streams every panel from memory whatever the number of rows (unpacked, a panel's rows
lie N floats apart, which the hardware prefetcher follows poorly: a batch of 8 rows took twice
its bandwidth floor).  Panels are float32, or int8 with a scale per 32 rows of each column
(a `QuantizedWeight`, kernels/quantized.py, packed): the kernel widens them in registers, so
the step streams a quarter of the bytes.  An unpacked `QuantizedWeight` takes the jnp path.

Why a kernel: under `lax.scan` XLA:CPU slices w[layer] into a fresh buffer before each dot (every
weight byte read, written and read again), and runs batch-1 dots on one thread.  The kernel takes
the whole stack and the layer index and reads the slice where it lies, on every core.  Several
weights sharing x (q, k, v; gate, up) go into one call, so a layer makes four calls.
On other platforms, and for other dtypes, the reference is the implementation (XLA fuses it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.cpu import build
from xlaserve.kernels.quantized import QuantizedWeight
from xlaserve.kernels.rms_norm import rms_norm


@jax.tree_util.register_pytree_node_class
class PackedWeight:
    """A stacked weight w [L, K, N] as column panels: panels[l, t, k, c] = w[l, k, t*TN + c]
    ([L, ceil(N / TN), K, TN], zero past N): float32, or int8 with the group scales laid out
    the same way ([L, ceil(N / TN), K / G, TN]; kernels/quantized.py)."""

    def __init__(self, panels: jax.Array, n: int, scales: jax.Array | None = None):
        self.panels = panels
        self.n = n
        self.scales = scales

    @property
    def shape(self) -> tuple[int, int, int]:   # the logical [L, K, N]
        return (self.panels.shape[0], self.panels.shape[2], self.n)

    @property
    def ndim(self) -> int:
        return 3

    @property
    def dtype(self) -> Any:   # the dtype it computes in
        return self.panels.dtype if self.scales is None else self.scales.dtype

    def kernel_args(self) -> tuple[jax.Array, ...]:
        """What the native kernels take for this weight: the panels [, their scales]."""
        return (self.panels,) if self.scales is None else (self.panels, self.scales)

    def unpacked(self) -> jax.Array:
        """The [L, K, N] weight again, dequantized (a copy: for the jnp path and tests)."""
        layers, t, k, tn = self.panels.shape
        w = self.panels.astype(self.dtype)
        if self.scales is not None:
            w = w * jnp.repeat(self.scales, k // self.scales.shape[2], axis=2)
        return w.transpose(0, 2, 1, 3).reshape(layers, k, t * tn)[:, :, :self.n]

    def tree_flatten(self) -> tuple[tuple[jax.Array, ...], int]:
        return self.kernel_args(), self.n

    @classmethod
    def tree_unflatten(cls, n: int, children: tuple[jax.Array, ...]) -> PackedWeight:
        return cls(children[0], n, children[1] if len(children) > 1 else None)


def pack_weight(w: jax.Array | QuantizedWeight) -> PackedWeight:
    """w [L, K, N] (float32, or int8 with its scales) -> its panels for the CPU kernel (a
    jitted copy, once at load)."""
    tn = build.matmul_tile_n()
    layers, _, n = w.shape
    t = -(-n // tn)

    @jax.jit
    def pack(w: jax.Array) -> jax.Array:   # [L, rows, N] -> [L, T, rows, TN]
        padded = jnp.pad(w, ((0, 0), (0, 0), (0, t * tn - n)))
        return padded.reshape(layers, w.shape[1], t, tn).transpose(0, 2, 1, 3)

    if isinstance(w, QuantizedWeight):   # scales [L, K / G, N] -> [L, T, K / G, TN]
        if w.q.dtype != jnp.int8:
            raise ValueError(f"pack_weight: the CPU kernels read int8 or float32 panels, not "
                             f"{w.q.dtype} (quantization='fp8' runs the jnp path: "
                             f"attention_backend='reference')")
        return PackedWeight(pack(w.q), n, pack(w.scale))
    return PackedWeight(pack(w), n)


Operand = jax.Array | PackedWeight | QuantizedWeight


def layer_matmul_reference(x: jax.Array, weights: Sequence[Operand],
                           layer: jax.Array) -> tuple[jax.Array, ...]:
    """x [M, K] @ w[layer] for each w [L, K, N] (or w [K, N]) -> tuple of [M, N]."""
    out = []
    for w in weights:
        if isinstance(w, QuantizedWeight):
            out.append(w.matmul_reference(x, layer))
            continue
        w = w.unpacked() if isinstance(w, PackedWeight) else w
        out.append(x @ (w[layer] if w.ndim == 3 else w))
    return tuple(out)


def gated_matmul_reference(gate: jax.Array, up: jax.Array, w: Operand,
                           layer: jax.Array) -> jax.Array:
    """(silu(gate) * up) @ w[layer]: gate, up [M, F], w [L, F, N] -> [M, N]."""
    (y,) = layer_matmul_reference(jax.nn.silu(gate) * up, (w,), layer)
    return y


def head_matmul_reference(x: jax.Array, table: jax.Array) -> jax.Array:
    """x [M, E] @ table [V, E]^T -> [M, V] float32 (contracted as stored: `table.T` copies)."""
    return jnp.einsum("me,ve->mv", x, table, preferred_element_type=jnp.float32)


def _check_x(name: str, x: jax.Array) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [M, K], got shape {x.shape}")


def check_layer_matmul(x: jax.Array, weights: Sequence[Operand]) -> None:
    _check_x("layer_matmul", x)
    if not weights:
        raise ValueError("layer_matmul needs at least one weight")
    for i, w in enumerate(weights):
        if w.ndim not in (2, 3) or w.shape[-2] != x.shape[1]:
            raise ValueError(f"layer_matmul: weight {i} must be [L, K, N] or [K, N] with "
                             f"K = {x.shape[1]}, got shape {w.shape}")
        # an int8 weight keeps float32 scales and computes in x's dtype (bfloat16 on a GPU)
        if w.dtype != x.dtype and not isinstance(w, QuantizedWeight):
            raise TypeError(f"layer_matmul: weight {i} is {w.dtype}, x is {x.dtype}")


def uses_kernel(x: jax.Array, use_kernel: bool) -> bool:
    """The native kernel runs float32 on CPU, when asked and when it was built."""
    return (use_kernel and x.dtype == jnp.float32 and jax.default_backend() == "cpu"
            and build.load() is not None)


def _check_residual(name: str, residual: jax.Array | None, shape: tuple[int, int],
                    dtype: Any) -> None:
    if residual is not None and (residual.shape != shape or residual.dtype != dtype):
        raise ValueError(f"{name}: residual must be {shape} {dtype} like the output, got "
                         f"{residual.shape} {residual.dtype}")


def layer_matmul(x: jax.Array, weights: Sequence[Operand], layer: jax.Array,
                 *, use_kernel: bool = True, residual: jax.Array | None = None,
                 norm: tuple[jax.Array, float] | None = None,
                 rows: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """(x @ w[layer] for w in weights): x [M, K], each w [L, K, N_i] (or packed) -> tuple of
    [M, N_i].  Packed weights go all together (one call) or not at all.  With `residual`
    [M, N] (one weight only): (residual + x @ w[layer],), in the same pass on packed panels.
    With `norm` = (g [L, K], eps): x is rms_norm(x, g[layer], eps) first, made inside the
    kernel's call on packed panels (XLA runs it as small single-threaded fusions).  With
    `rows` ([] int32): only x's first `rows` rows count, the outputs' later rows are zeros
    (a step's padding: packed panels skip its FMAs)."""
    weights = tuple(weights)
    check_layer_matmul(x, weights)
    if rows is not None and not (all(isinstance(w, PackedWeight) for w in weights)
                                 and uses_kernel(x, use_kernel)):
        return tuple(zero_rows_past(y, rows) for y in layer_matmul(
            x, weights, layer, use_kernel=use_kernel, residual=residual, norm=norm))
    used = _rows_operand(x, rows)
    if norm is not None:
        g, eps = norm
        if g.ndim != 2 or g.shape[1] != x.shape[1] or g.dtype != x.dtype:
            raise ValueError(f"layer_matmul: norm weights must be [L, K={x.shape[1]}] "
                             f"{x.dtype}, got {g.shape} {g.dtype}")
        if residual is not None:
            raise ValueError("layer_matmul: norm and residual do not go together")
        if not (all(isinstance(w, PackedWeight) for w in weights) and uses_kernel(x, use_kernel)):
            return layer_matmul(rms_norm(x, g[layer], eps), weights, layer,
                                use_kernel=use_kernel)
        out = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), jnp.float32)
                    for w in weights)
        return tuple(jax.ffi.ffi_call("xlaserve_cpu_matmul_packed_normed", out)(
            x, jnp.asarray(layer, jnp.int32).reshape(()), used, g,
            *(a for w in weights for a in w.kernel_args()), eps=np.float32(eps)))
    if residual is not None:
        if len(weights) != 1:
            raise ValueError(f"layer_matmul: a residual goes with one weight, got "
                             f"{len(weights)}")
        _check_residual("layer_matmul", residual, (x.shape[0], weights[0].shape[-1]), x.dtype)
        w = weights[0]
        if isinstance(w, PackedWeight) and uses_kernel(x, use_kernel):
            out = jax.ShapeDtypeStruct(residual.shape, jnp.float32)
            layer = jnp.asarray(layer, jnp.int32).reshape(())
            return (jax.ffi.ffi_call("xlaserve_cpu_matmul_packed_add", out)(
                x, layer, used, residual, *w.kernel_args()),)
        (y,) = layer_matmul(x, weights, layer, use_kernel=use_kernel)
        return (residual + y,)
    packed = [isinstance(w, PackedWeight) for w in weights]
    if not uses_kernel(x, use_kernel) or any(isinstance(w, QuantizedWeight) for w in weights):
        return layer_matmul_reference(x, weights, layer)   # int8 reaches the kernels packed
    out = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), jnp.float32) for w in weights)
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    if all(packed):
        return tuple(jax.ffi.ffi_call("xlaserve_cpu_matmul_packed", out)(
            x, layer, used, *(a for w in weights for a in w.kernel_args())))
    if any(packed):
        raise ValueError("layer_matmul: packed and unpacked weights in one call")
    return tuple(jax.ffi.ffi_call("xlaserve_cpu_matmul", out)(x, layer, *weights))


def gated_matmul(gate: jax.Array, up: jax.Array, w: Operand,
                 layer: jax.Array, *, use_kernel: bool = True,
                 residual: jax.Array | None = None, rows: jax.Array | None = None
                 ) -> jax.Array:
    """The MLP's down projection, [residual +] (silu(gate) * up) @ w[layer]: gate, up [M, F],
    w [L, F, N] (or packed), residual [M, N] -> [M, N].  On packed weights the kernel makes
    the activations itself, on every core (XLA's fused silu runs on one), and adds the
    residual as it writes; otherwise silu * up, then layer_matmul.  `rows` as in
    layer_matmul."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gated_matmul: gate {gate.shape} {gate.dtype} and up {up.shape} "
                         f"{up.dtype} must match")
    if not (isinstance(w, PackedWeight) and uses_kernel(gate, use_kernel)):
        (y,) = layer_matmul(jax.nn.silu(gate) * up, (w,), layer, use_kernel=use_kernel,
                            residual=residual, rows=rows)
        return y
    check_layer_matmul(gate, (w,))
    _check_residual("gated_matmul", residual, (gate.shape[0], w.shape[-1]), gate.dtype)
    out = jax.ShapeDtypeStruct((gate.shape[0], w.shape[-1]), jnp.float32)
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    extra = () if residual is None else (residual,)
    return jax.ffi.ffi_call("xlaserve_cpu_matmul_packed_gated", out)(
        gate, up, layer, _rows_operand(gate, rows), *w.kernel_args(), *extra)


def zero_rows_past(y: jax.Array, rows: jax.Array) -> jax.Array:
    """y [M, N] with its rows from `rows` on zeroed (the kernels' `rows` on the jnp path)."""
    return jnp.where((jnp.arange(y.shape[0]) < rows)[:, None], y, 0.0).astype(y.dtype)


def _rows_operand(x: jax.Array, rows: jax.Array | None) -> jax.Array:
    """The kernels' `rows` operand: [] int32, every row of x [M, K] when None."""
    return jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32).reshape(())


def head_matmul(x: jax.Array, table: jax.Array, *, use_kernel: bool = True) -> jax.Array:
    """x [M, E] @ table [V, E]^T -> logits [M, V] float32."""
    _check_x("head_matmul", x)
    if table.ndim != 2 or table.shape[1] != x.shape[1]:
        raise ValueError(f"head_matmul: table must be [V, E={x.shape[1]}], got {table.shape}")
    if not uses_kernel(x, use_kernel) or table.dtype != jnp.float32:
        return head_matmul_reference(x, table)
    out = jax.ShapeDtypeStruct((x.shape[0], table.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("xlaserve_cpu_matmul_nt", out)(x, table)
