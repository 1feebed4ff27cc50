"""int8 weights: the group-wise quantizer and the native int8 panel matmuls against the jnp
reference over the dequantized weight, on random shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels import matmul as mm
from xlaserve.kernels.cpu import build
from xlaserve.kernels.quantized import GROUP, QuantizedWeight, dequantize, quantize_int8

needs_kernels = pytest.mark.skipif(build.load() is None, reason="CPU kernels not built")
TOL = 5e-6   # relative to the output's largest magnitude: float32 sums in another order


def _quantized(rng: np.random.Generator, layers: int, k: int, n: int
               ) -> tuple[QuantizedWeight, jax.Array]:
    w = rng.standard_normal((layers, k, n)).astype(np.float32)
    q = quantize_int8(w, 1)
    return (QuantizedWeight(jnp.asarray(q["q"]), jnp.asarray(q["scale"])),
            jnp.asarray(dequantize(q, 1)))


def _close(got: jax.Array, want: jax.Array) -> None:
    scale = float(jnp.max(jnp.abs(want)))
    err = float(jnp.max(jnp.abs(got - want)))
    assert err <= TOL * scale, f"max |error| {err:.3e} against max |value| {scale:.3e}"


def test_quantizer_rounds_each_group_to_its_own_scale() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 96, 5, 7)).astype(np.float32)
    w[1, :GROUP, 2, 3] = 0.0                       # an all-zero group: scale 1, q 0
    q = quantize_int8(w, 1)
    assert q["q"].dtype == np.int8 and q["q"].shape == w.shape
    assert q["scale"].shape == (3, 96 // GROUP, 5, 7) and q["scale"].dtype == np.float32
    assert np.abs(q["q"]).max() == 127
    assert q["scale"][1, 0, 2, 3] == 1.0 and not q["q"][1, :GROUP, 2, 3].any()
    err = np.abs(dequantize(q, 1) - w)
    bound = np.repeat(q["scale"], GROUP, axis=1) / 2   # half a step of each group's grid
    assert (err <= bound * (1 + 1e-6)).all()
    # the same on device, under jit
    qj = jax.jit(lambda a: quantize_int8(a, 1))(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(qj["q"]), q["q"])
    np.testing.assert_allclose(np.asarray(qj["scale"]), q["scale"], rtol=1e-6)


def test_quantizer_names_a_bad_group() -> None:
    with pytest.raises(ValueError, match="40 elements, not a multiple of the group size 32"):
        quantize_int8(np.ones((2, 40, 8), np.float32), 1)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 17, 70])
@pytest.mark.parametrize("k,n", [(96, 100), (576, 1536), (160, 17)])
def test_int8_panels_match_the_dequantized_reference(rows: int, k: int, n: int) -> None:
    rng = np.random.default_rng(rows * 1000 + k + n)
    w, dense = _quantized(rng, 3, k, n)
    w2, dense2 = _quantized(rng, 3, k, n + 5)
    p, p2 = mm.pack_weight(w), mm.pack_weight(w2)
    np.testing.assert_allclose(np.asarray(p.unpacked()), np.asarray(dense), rtol=0, atol=0)
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    res = jnp.asarray(rng.standard_normal((rows, n)).astype(np.float32))
    layer = jnp.int32(2)
    y, y2 = mm.layer_matmul(x, (p, p2), layer)                 # two weights, one call
    _close(y, x @ dense[2])
    _close(y2, x @ dense2[2])
    (yr,) = mm.layer_matmul(x, (p,), layer, residual=res)      # o: the residual add inside
    _close(yr, res + x @ dense[2])
    gate = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    down = mm.gated_matmul(gate, x, p, layer, residual=res)   # down: silu(gate) * up inside
    _close(down, res + (jax.nn.silu(gate) * x) @ dense[2])
    (ref,) = mm.layer_matmul(x, (w,), layer)                   # the jnp path, unpacked
    _close(ref, x @ dense[2])


@needs_kernels
def test_kernel_refuses_scales_of_the_wrong_shape() -> None:
    rng = np.random.default_rng(1)
    w, _ = _quantized(rng, 2, 64, 48)
    p = mm.pack_weight(w)
    bad = mm.PackedWeight(p.panels, p.n, p.scales[:, :, :1, :1])
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(Exception, match="scales of an s8 weight"):
        jax.block_until_ready(mm.layer_matmul(x, (bad,), jnp.int32(0)))
