"""fp8 (e4m3) weights and KV rows, a GPU option run here through the jnp path under the
test-only override (XLASERVE_FP8_ON_CPU=1): the quantizer's error bound, the matmul and the
attention over fp8 rows against float references on random shapes, and the refusal on CPU
without the override, naming the option.

Bounds: e4m3 keeps 3 mantissa bits, so a value in the normal range rounds within 2^-4 of
itself (half an ulp); below 2^-6 of 448 x scale (the subnormals) within half their step,
scale x 2^-10.  Each bound below is that per-element bound carried through the sum."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.test_ragged_attention import flat_and_padded
from xlaserve.kernels import matmul as mm
from xlaserve.kernels.attention import attention
from xlaserve.kernels.kv_quant import dequantize_rows, quantize_rows, row_width, to_cache_rows
from xlaserve.kernels.quantized import (
    FP8_ON_CPU_ENV,
    GROUP,
    QuantizedWeight,
    dequantize,
    quantize_fp8,
)
from xlaserve.kernels.ragged_attention import ragged_attention_reference

FP8 = jnp.float8_e4m3fn
HALF_ULP = 2.0 ** -4          # relative, normal range
SUBNORMAL_HALF_STEP = 2.0 ** -10   # times the scale


def _bound(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The largest |w - fp8(w)| for each element, scale broadcast to w."""
    return np.abs(w) * HALF_ULP + scale * SUBNORMAL_HALF_STEP


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    monkeypatch.setenv(FP8_ON_CPU_ENV, "1")


def test_quantizer_keeps_each_weight_within_half_an_ulp() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 96, 5, 7)) * np.exp(rng.uniform(-6, 2, (3, 96, 5, 7))))
    w = w.astype(np.float32)
    w[1, :GROUP, 2, 3] = 0.0                       # an all-zero group: scale 1, q 0
    q = quantize_fp8(w, 1)
    assert q["q"].dtype == FP8 and q["q"].shape == w.shape
    assert q["scale"].shape == (3, 96 // GROUP, 5, 7) and q["scale"].dtype == np.float32
    assert np.isfinite(q["q"].astype(np.float32)).all()
    assert np.abs(q["q"].astype(np.float32)).max() == 448.0
    back = dequantize(q, 1)
    scale = np.repeat(q["scale"], GROUP, axis=1)
    assert (np.abs(back - w) <= _bound(w, scale) * (1 + 1e-6)).all()
    assert not back[1, :GROUP, 2, 3].any()
    # numpy (conversion) and jax (load-time quantization) give the same bytes
    qj = jax.jit(lambda a: quantize_fp8(a, 1))(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(qj["q"]).view(np.uint8), q["q"].view(np.uint8))


@pytest.mark.parametrize("m,k,n,layers", [(1, 64, 48, 2), (7, 288, 130, 3), (33, 96, 576, 1)])
def test_fp8_matmul_within_its_bound_of_the_float_one(fp8_on_cpu, m, k, n, layers) -> None:
    """x @ w over fp8 weights (the jnp path: dequantized into the dot) against x @ w in
    float32: |error| <= sum_k |x_k| bound(w_k), and exactly x @ dequantize(q)."""
    rng = np.random.default_rng(m * k)
    w = rng.standard_normal((layers, k, n)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    q = quantize_fp8(w, 1)
    qw = QuantizedWeight(jnp.asarray(q["q"]), jnp.asarray(q["scale"]))
    for layer in range(layers):
        (got,) = jax.jit(lambda x, i: mm.layer_matmul(x, (qw,), i))(x, jnp.int32(layer))
        want = np.asarray(x) @ w[layer]
        scale = np.repeat(q["scale"][layer], GROUP, axis=0)
        bound = np.abs(np.asarray(x)) @ _bound(w[layer], scale)
        assert (np.abs(np.asarray(got) - want) <= bound * (1 + 1e-4) + 1e-5).all()
        exact = np.asarray(x) @ dequantize(q, 1)[layer]
        np.testing.assert_allclose(np.asarray(got), exact, rtol=2e-5, atol=2e-5)
    # the worst case is far from typical: the mean error is ~1-2% of the mean |output|
    err = np.abs(np.asarray(got) - want).mean() / np.abs(want).mean()
    assert err < 3e-2, err


def test_fp8_rows_keep_their_scale_and_round_within_half_an_ulp(fp8_on_cpu) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 80)).astype(np.float32) * 7
    x[1, 2] = 0.0
    rows = jax.jit(lambda a: to_cache_rows(a, FP8))(jnp.asarray(x))
    assert rows.dtype == FP8 and rows.shape == (5, 3, row_width(80, FP8)) == (5, 3, 84)
    back = np.asarray(dequantize_rows(rows))
    scale = np.abs(x).max(-1, keepdims=True) / 448
    assert (np.abs(back - x) <= _bound(x, np.where(scale > 0, scale, 1)) * (1 + 1e-6)).all()
    assert not back[1, 2].any()


# seed, q_lens, prefixes, group, head_dim, bs, window, cap (test_kv_quant.py's shapes)
CASES = [
    (11, [1] * 16, list(range(0, 1024, 64)), 3, 64, 16, None, None),
    (13, [9, 1], [100, 31], 1, 80, 16, 50, 30.0),
]


@pytest.mark.parametrize("seed,q_lens,prefixes,group,head_dim,bs,window,cap", CASES)
def test_attention_reads_fp8_rows_as_the_dequantized_cache(fp8_on_cpu, seed, q_lens, prefixes,
                                                           group, head_dim, bs, window,
                                                           cap) -> None:
    """The reference (and, one small case, Pallas in interpret mode) over fp8 rows gives the
    reference over the dequantized cache; that is within 6% of the float cache's output."""
    _, flat, pick = flat_and_padded(seed, q_lens, prefixes, group, head_dim, bs)
    f8 = dataclasses.replace(flat, k_flat=quantize_rows(flat.k_flat, FP8),
                             v_flat=quantize_rows(flat.v_flat, FP8))
    dense = dataclasses.replace(f8, k_flat=dequantize_rows(f8.k_flat),
                                v_flat=dequantize_rows(f8.v_flat))
    kw = dict(**flat.kw(), soft_cap=cap, sliding_window=window)
    want = np.asarray(ragged_attention_reference(*dense.args(), **kw))
    for backend in ["reference"] + (["pallas"] if seed == 13 else []):
        got = jax.jit(lambda *a, b=backend: attention(*a, **kw, backend=b))(*f8.args())
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 *
                                   np.abs(want).max(), err_msg=backend)
        np.testing.assert_array_equal(np.asarray(got)[pick[:, 0] < 0], 0.0)
    exact = np.asarray(ragged_attention_reference(*flat.args(), **kw))
    assert np.abs(want - exact).max() < 6e-2 * np.abs(exact).max()


def test_fp8_is_refused_on_cpu_without_the_override(monkeypatch) -> None:
    monkeypatch.delenv(FP8_ON_CPU_ENV, raising=False)
    q = quantize_fp8(np.ones((1, 32, 8), np.float32), 1)
    qw = QuantizedWeight(jnp.asarray(q["q"]), jnp.asarray(q["scale"]))
    with pytest.raises(ValueError, match=r"quantization='fp8' is a GPU option: XLA:CPU"):
        mm.layer_matmul(jnp.ones((2, 32), jnp.float32), (qw,), jnp.int32(0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is a GPU option.*"
                                         + FP8_ON_CPU_ENV):
        to_cache_rows(jnp.ones((2, 1, 16), jnp.float32), FP8)
    # the CPU kernels read int8 panels only: an fp8 weight is refused, not misread
    monkeypatch.setenv(FP8_ON_CPU_ENV, "1")
    with pytest.raises(ValueError, match=r"not float8_e4m3fn"):
        mm.pack_weight(qw)
