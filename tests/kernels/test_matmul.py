"""The native CPU weight matmuls against their jnp references, on random shapes: small and
large M, K and N that are and are not multiples of the vector width and the column tile, several
weights in one call, the layer index reading its own slice of the stack."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.kernel_cases import rel_error
from xlaserve.kernels.matmul import (
    head_matmul,
    head_matmul_reference,
    layer_matmul,
    layer_matmul_reference,
    uses_kernel,
)


def test_the_kernel_is_built_and_used_on_cpu():
    assert uses_kernel(jnp.zeros((1, 4), jnp.float32), True)
    assert not uses_kernel(jnp.zeros((1, 4), jnp.bfloat16), True)
    assert not uses_kernel(jnp.zeros((1, 4), jnp.float32), False)


@pytest.mark.parametrize("m,k,ns", [
    (1, 576, (576, 192, 192)),   # SmolLM2 q, k, v in one call
    (3, 64, (1536, 1536)),       # gate, up
    (8, 1536, (576,)),           # down
    (9, 100, (37, 16, 48)),      # column tails: 37 = 2 x 16 + 5, one whole tile
    (32, 50, (200,)),
    (257, 128, (64, 49)),        # prefill-sized M, not a multiple of the row tile
])
def test_layer_matmul_matches_reference(m, k, ns):
    rng = np.random.default_rng(m * 1000 + k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((4, k, n)), jnp.float32) for n in ns]
    for layer in (0, 3):
        got = jax.jit(lambda x, *w: layer_matmul(x, w, jnp.int32(layer)))(x, *ws)
        want = layer_matmul_reference(x, ws, layer)
        assert len(got) == len(ns)
        for g, w, n in zip(got, want, ns):
            assert g.shape == (m, n)
            assert rel_error(g, w) < 1e-5


def test_layer_matmul_takes_an_unstacked_weight():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 40)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 70)), jnp.float32)
    (got,) = layer_matmul(x, (w,), jnp.int32(0))
    assert rel_error(got, x @ w) < 1e-5


@pytest.mark.parametrize("m,k,n", [(1, 576, 49152), (5, 50, 130), (32, 576, 1000),
                                   (17, 33, 7)])
def test_head_matmul_matches_reference(m, k, n):
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    got = jax.jit(head_matmul)(x, table)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert rel_error(got, head_matmul_reference(x, table)) < 1e-5


def test_shapes_are_checked_with_their_values():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"K = 8, got shape \(3, 9, 4\)"):
        layer_matmul(x, (jnp.zeros((3, 9, 4)),), jnp.int32(0))
    with pytest.raises(ValueError, match=r"table must be \[V, E=8\], got \(4, 9\)"):
        head_matmul(x, jnp.zeros((4, 9)))


@pytest.mark.parametrize("m", [1, 3, 8, 20, 32, 33, 130])
def test_packed_weights_match_the_unpacked(m):
    """Panels of TILE_N columns, the last one padded (N = 200 is not a multiple of 48 or 16);
    the row counts take every register tile height and tail (8 / 6, then 4, 2, 1)."""
    from xlaserve.kernels.matmul import pack_weight

    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 96)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((3, 96, n)), jnp.float32) for n in (200, 48, 576)]
    packed = [pack_weight(w) for w in ws]
    assert [p.shape for p in packed] == [w.shape for w in ws]
    np.testing.assert_array_equal(np.asarray(packed[0].unpacked()), np.asarray(ws[0]))
    for layer in (0, 2):
        got = jax.jit(lambda x, *p: layer_matmul(x, p, jnp.int32(layer)))(x, *packed)
        for g, w in zip(got, layer_matmul_reference(x, ws, layer)):
            assert rel_error(g, w) < 1e-5
    with pytest.raises(ValueError, match="packed and unpacked"):
        layer_matmul(x, (packed[0], ws[1]), jnp.int32(0))


@pytest.mark.parametrize("m,f,n", [(1, 1536, 576), (3, 100, 200), (16, 64, 48), (17, 70, 30),
                                   (130, 96, 576)])
def test_gated_matmul_matches_reference(m, f, n):
    """(silu(gate) * up) @ w: M on both sides of the kernel's 16-row activation items, F not a
    multiple of the vector width, gates deep into both tails of silu."""
    from xlaserve.kernels.matmul import gated_matmul, gated_matmul_reference, pack_weight

    rng = np.random.default_rng(m * 7 + f)
    gate = jnp.asarray(rng.standard_normal((m, f)) * 4, jnp.float32)
    gate = gate.at[0, :4].set(jnp.array([-120.0, -30.0, 30.0, 120.0]))
    up = jnp.asarray(rng.standard_normal((m, f)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, f, n)), jnp.float32)
    packed = pack_weight(w)
    for layer in (0, 2):
        want = gated_matmul_reference(gate, up, w, layer)
        got = jax.jit(lambda g, u, p: gated_matmul(g, u, p, jnp.int32(layer)))(gate, up, packed)
        assert got.shape == (m, n) and bool(jnp.isfinite(got).all())
        assert rel_error(got, want) < 1e-5
        unpacked = jax.jit(lambda g, u, w: gated_matmul(g, u, w, jnp.int32(layer)))(gate, up, w)
        assert rel_error(unpacked, want) < 1e-5
        res = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
        for weight in (packed, w):
            added = jax.jit(lambda g, u, p, r: gated_matmul(g, u, p, jnp.int32(layer),
                                                            residual=r))(gate, up, weight, res)
            assert rel_error(added, res + want) < 1e-5
    with pytest.raises(ValueError, match=r"gate \(1, 4\) float32 and up \(1, 5\)"):
        gated_matmul(jnp.zeros((1, 4)), jnp.zeros((1, 5)), packed, jnp.int32(0))


@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (5, 64, 200), (70, 96, 48)])
def test_residual_goes_into_the_matmul(m, k, n):
    """layer_matmul(..., residual=r) = r + x @ w, packed (one kernel pass) and not."""
    from xlaserve.kernels.matmul import pack_weight

    rng = np.random.default_rng(m + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, k, n)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    want = r + layer_matmul_reference(x, (w,), 1)[0]
    for weight in (pack_weight(w), w):
        (got,) = jax.jit(lambda x, p, r: layer_matmul(x, (p,), jnp.int32(1), residual=r))(
            x, weight, r)
        assert rel_error(got, want) < 1e-5
    with pytest.raises(ValueError, match="a residual goes with one weight, got 2"):
        layer_matmul(x, (w, w), jnp.int32(0), residual=r)
    with pytest.raises(ValueError, match=rf"residual must be \({m}, {n}\) float32"):
        layer_matmul(x, (w,), jnp.int32(0), residual=r[:, :1])


@pytest.mark.parametrize("m,k,ns", [(1, 576, (576, 192, 192)), (3, 100, (37, 48)),
                                    (16, 64, (200,)), (17, 70, (30, 31)), (130, 96, (576,)),
                                    (40, 1536, (64,))])
def test_the_pre_norm_goes_into_the_matmul(m, k, ns):
    """norm=(g, eps): rms_norm(x, g[layer]) @ w in one call on packed panels, float32 and int8
    (M on both sides of the kernel's 16-row norm items, K not a multiple of the vector width,
    rows of very different scale); unpacked weights take rms_norm then the matmul."""
    from xlaserve.kernels.matmul import pack_weight
    from xlaserve.kernels.quantized import GROUP, QuantizedWeight, quantize_int8
    from xlaserve.kernels.rms_norm import rms_norm

    rng = np.random.default_rng(m * 31 + k)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 30.0], (m, 1)),
                    jnp.float32)
    g = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32) for n in ns]
    forms = [[pack_weight(w) for w in ws], ws]
    if k % GROUP == 0:   # int8 groups run along K
        forms.append([pack_weight(QuantizedWeight(jnp.asarray(q["q"]), jnp.asarray(q["scale"])))
                      for q in (quantize_int8(np.asarray(w), 1) for w in ws)])
    for weights in forms:
        for layer in (0, 2):
            want = layer_matmul_reference(rms_norm(x, g[layer], 1e-5), weights, layer)
            got = jax.jit(lambda x, g, *w: layer_matmul(x, w, jnp.int32(layer),
                                                        norm=(g, 1e-5)))(x, g, *weights)
            for a, b in zip(got, want):
                assert a.shape == b.shape and rel_error(a, b) < 1e-5
    with pytest.raises(ValueError, match=r"norm weights must be \[L, K=100\] float32, got "
                                         r"\(3, 99\)"):
        layer_matmul(jnp.zeros((1, 100)), (jnp.zeros((3, 100, 4)),), jnp.int32(0),
                     norm=(jnp.zeros((3, 99)), 1e-5))


def test_the_normed_call_replaces_xlas_norm_fusions():
    """The compiled layer holds the kernel call and no reduction of its own for the norm."""
    from xlaserve.kernels.matmul import pack_weight

    x, g = jnp.ones((4, 64), jnp.float32), jnp.ones((2, 64), jnp.float32)
    w = pack_weight(jnp.ones((2, 64, 96), jnp.float32))
    hlo = jax.jit(lambda x, g, w: layer_matmul(x, (w,), jnp.int32(1), norm=(g, 1e-6))).lower(
        x, g, w).compile().as_text()
    assert "xlaserve_cpu_matmul_packed_normed" in hlo
    assert "reduce" not in hlo and "rsqrt" not in hlo, hlo


@pytest.mark.parametrize("m,used", [(64, 37), (16, 1), (9, 9), (40, 0), (8, 99)])
def test_rows_past_the_used_ones_are_zeros(m, used):
    """rows=n: the first n rows (clamped to [0, M]) as without it, the rest zeros, on every
    packed call (plain, pre-norm, residual, gated) and on the unpacked path alike."""
    from xlaserve.kernels.matmul import gated_matmul, gated_matmul_reference, pack_weight

    rng = np.random.default_rng(m + used)
    k, n = 96, 53
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    up = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, k, n)), jnp.float32)
    keep = (np.arange(m) < used)[:, None]
    calls = {
        "plain": (lambda w, n_: layer_matmul(x, (w,), jnp.int32(1), rows=n_)[0],
                  layer_matmul_reference(x, (w,), 1)[0]),
        "residual": (lambda w, n_: layer_matmul(x, (w,), jnp.int32(1), residual=r, rows=n_)[0],
                     r + layer_matmul_reference(x, (w,), 1)[0]),
        "gated": (lambda w, n_: gated_matmul(x, up, w, jnp.int32(1), residual=r, rows=n_),
                  r + gated_matmul_reference(x, up, w, 1)),
    }
    from xlaserve.kernels.rms_norm import rms_norm
    calls["norm"] = (lambda w, n_: layer_matmul(x, (w,), jnp.int32(1), norm=(g, 1e-5),
                                                rows=n_)[0],
                     layer_matmul_reference(rms_norm(x, g[1], 1e-5), (w,), 1)[0])
    for name, (call, full) in calls.items():
        want = np.where(keep, np.asarray(full), 0.0)
        for weight in (pack_weight(w), w):
            got = np.asarray(jax.jit(call)(weight, jnp.int32(used)))
            assert rel_error(got, want) < 1e-5, name
            assert not got[min(used, m):].any(), name
