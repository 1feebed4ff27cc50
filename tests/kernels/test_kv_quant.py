"""The int8 KV cache: rows quantize within half a step of their scale, and every attention
backend (reference, the CPU kernel, Pallas) reading int8 rows gives what the reference gives
over the dequantized float cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.kernel_cases import rel_error
from tests.kernels.test_ragged_attention import flat_and_padded
from xlaserve.kernels.attention import attention
from xlaserve.kernels.cpu import build
from xlaserve.kernels.kv_quant import dequantize_rows, quantize_rows, row_width
from xlaserve.kernels.ragged_attention import ragged_attention_reference


def test_rows_round_within_half_a_step_and_keep_their_scale() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 80)).astype(np.float32) * 7
    x[1, 2] = 0.0                                   # an all-zero row: scale 1, zeros back
    rows = quantize_rows(jnp.asarray(x))
    assert rows.dtype == jnp.int8 and rows.shape == (5, 3, row_width(80, "int8")) == (5, 3, 84)
    back = np.asarray(dequantize_rows(rows))
    scale = np.abs(x).max(-1, keepdims=True) / 127
    assert (np.abs(back - x) <= np.where(scale > 0, scale, 1) / 2 * (1 + 1e-6)).all()
    assert not back[1, 2].any()
    assert row_width(80, "float32") == 80


def _int8(flat):
    return dataclasses.replace(flat, k_flat=quantize_rows(flat.k_flat),
                               v_flat=quantize_rows(flat.v_flat))


# seed, q_lens, prefixes, group, head_dim, bs, window, cap: decode rows and prefill chunks in
# one batch, block sizes 16 and 32, GQA groups 1-8, head_dim 80 (not a vector multiple).
CASES = [
    (11, [1] * 16, list(range(0, 1024, 64)), 3, 64, 16, None, None),
    (12, [1, 40, 1], [2000, 300, 7], 8, 128, 32, None, None),
    (13, [9, 1], [100, 31], 1, 80, 16, 50, 30.0),
]


@pytest.mark.parametrize("seed,q_lens,prefixes,group,head_dim,bs,window,cap", CASES)
def test_backends_read_int8_rows_as_the_dequantized_cache(seed, q_lens, prefixes, group,
                                                          head_dim, bs, window, cap) -> None:
    _, flat, pick = flat_and_padded(seed, q_lens, prefixes, group, head_dim, bs)
    q8 = _int8(flat)
    dense = dataclasses.replace(q8, k_flat=dequantize_rows(q8.k_flat),
                                v_flat=dequantize_rows(q8.v_flat))
    kw = dict(**flat.kw(), soft_cap=cap, sliding_window=window)
    want = ragged_attention_reference(*dense.args(), **kw)
    backends = ["reference"] + (["cpu"] if build.load() is not None else [])
    if seed == 13:   # Pallas interprets its grid program by program on CPU: one small case
        backends.append("pallas")
    for backend in backends:
        got = jax.jit(lambda *a, b=backend: attention(*a, **kw, backend=b))(*q8.args())
        assert rel_error(got, want) < 1e-5, backend
        np.testing.assert_array_equal(np.asarray(got)[pick[:, 0] < 0], 0.0)
    # and the int8 cache is close to the float one it was made from
    assert rel_error(want, ragged_attention_reference(*flat.args(), **kw)) < 5e-2
