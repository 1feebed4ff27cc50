"""Ragged paged attention over a flat batch: the jnp reference against the padded reference
(same semantics), and the native CPU kernel against the reference on random shapes, over
float32 caches and the 16-bit ones (every half and bfloat16 bit pattern read exactly)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.kernels.kernel_cases import make_case, rel_error, to_flat

from xlaserve.kernels.prefill_attention import prefill_attention_reference
from xlaserve.kernels.ragged_attention import ragged_attention, ragged_attention_reference

GQA = {1: (4, 4), 2: (4, 2), 3: (9, 3), 8: (8, 1)}  # group -> (heads, kv_heads)


def flat_and_padded(seed, q_lens, prefixes, group, head_dim, bs, dtype=jnp.float32,
                    padding=3, width=None):
    heads, kvh = GQA[group]
    chunk = max(q_lens)
    case = make_case(seed, q_lens=q_lens, prefixes=prefixes, chunk=chunk, heads=heads,
                     kv_heads=kvh, head_dim=head_dim, block_size=bs, dtype=dtype, width=width)
    flat, pick = to_flat(case, padding)
    return case, flat, pick


@pytest.mark.parametrize("window,cap,dtype", [(None, None, jnp.float32), (7, None, jnp.float32),
                                              (None, 20.0, jnp.float32),
                                              (None, None, jnp.bfloat16)])
def test_reference_matches_the_padded_reference(window, cap, dtype):
    case, flat, pick = flat_and_padded(0, [1, 9, 4, 1], [30, 0, 17, 5], 3, 16, 8, dtype)
    kw = dict(soft_cap=cap, sliding_window=window)
    out = ragged_attention_reference(*flat.args(), **flat.kw(), **kw)
    padded = prefill_attention_reference(case.q, case.k_cache, case.v_cache, case.layer,
                                         case.block_tables, case.q_lens, case.kv_lens,
                                         scale=case.scale, **kw)
    real = pick[:, 0] >= 0
    want = np.asarray(padded, np.float32)[pick[real, 0], pick[real, 1]]
    assert rel_error(np.asarray(out, np.float32)[real], want) < (
        1e-6 if dtype == jnp.float32 else 1e-2)
    np.testing.assert_array_equal(np.asarray(out[~real], np.float32), 0.0)


# Rows 1-64, contexts 1-2048, block sizes 16 and 32, GQA groups 1-8, head dims 64 / 128 / 80
# (not a multiple of the vector width on AVX-512), windows and soft caps; decode rows (one
# token) and prefill chunks mixed in one batch, stale table entries past each row's blocks.
CASES = [
    # seed, q_lens, prefixes, group, head_dim, bs, window, cap
    (1, [1] * 64, list(range(0, 2048, 32)), 3, 64, 16, None, None),
    (2, [1, 1, 200, 1, 37], [2047, 0, 300, 15, 1000], 8, 128, 32, None, None),
    (3, [16, 1, 5], [0, 700, 31], 1, 64, 16, 100, None),
    (4, [64, 1, 1, 9], [1500, 12, 0, 2], 2, 80, 16, None, 30.0),
    (5, [1, 33], [1, 990], 3, 64, 32, 1, None),
    (6, [128], [1920], 8, 64, 16, 333, 50.0),
]


@pytest.mark.parametrize("seed,q_lens,prefixes,group,head_dim,bs,window,cap", CASES)
def test_cpu_kernel_matches_reference(seed, q_lens, prefixes, group, head_dim, bs, window, cap):
    _, flat, pick = flat_and_padded(seed, q_lens, prefixes, group, head_dim, bs)
    kw = dict(**flat.kw(), soft_cap=cap, sliding_window=window)
    out = jax.jit(lambda *a: ragged_attention(*a, **kw))(*flat.args())
    ref = ragged_attention_reference(*flat.args(), **kw)
    assert out.shape == ref.shape and out.dtype == jnp.float32
    assert rel_error(out, ref) < 1e-5
    padding = pick[:, 0] < 0
    np.testing.assert_array_equal(np.asarray(out)[padding], 0.0)


@pytest.mark.parametrize("cache_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("seed,q_lens,prefixes,group,head_dim,bs,window,cap",
                         [CASES[1], CASES[3]])
def test_cpu_kernel_reads_16_bit_caches_as_the_reference_does(seed, q_lens, prefixes, group,
                                                              head_dim, bs, window, cap,
                                                              cache_dtype):
    _, flat, pick = flat_and_padded(seed, q_lens, prefixes, group, head_dim, bs)
    flat = dataclasses.replace(flat, k_flat=flat.k_flat.astype(cache_dtype),
                               v_flat=flat.v_flat.astype(cache_dtype))
    kw = dict(**flat.kw(), soft_cap=cap, sliding_window=window)
    out = jax.jit(lambda *a: ragged_attention(*a, **kw))(*flat.args())
    ref = ragged_attention_reference(*flat.args(), **kw)   # widens the cache with astype
    assert out.dtype == jnp.float32 and rel_error(out, ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[pick[:, 0] < 0], 0.0)


@pytest.mark.parametrize("cache_dtype", [jnp.float16, jnp.bfloat16])
def test_cpu_kernel_widens_every_16_bit_pattern_exactly(cache_dtype):
    # Row r's only token is at position 0 and sees one key (k = 0): its output is its value
    # row exactly, so the kernel's widening of all 65536 bit patterns (subnormals, +-inf, nan)
    # is compared with numpy's, bit for bit (+0 and -0 alike: acc starts at +0).  XLA's CPU
    # threads flush float32 subnormals to zero, so the bfloat16 patterns that are float32
    # subnormals come out 0, as they do from the reference.
    d, bs = 64, 16
    rows = 65536 // d
    bits = np.arange(65536, dtype=np.uint16).reshape(rows, 1, d)
    v_rows = jnp.asarray(bits.view(np.dtype(cache_dtype)))                  # [rows, 1, D]
    v_flat = jnp.zeros((rows * bs, 1, d), cache_dtype).at[::bs].set(v_rows)
    k_flat = jnp.zeros_like(v_flat)
    out = ragged_attention(jnp.ones((rows, 1, d), jnp.float32), k_flat, v_flat, jnp.int32(0),
                           jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, jnp.int32),
                           jnp.arange(rows, dtype=jnp.int32)[:, None], num_blocks=rows,
                           block_size=bs, scale=0.125)
    want = np.asarray(v_rows, np.float32)
    want[np.abs(want) < np.finfo(np.float32).tiny] = 0.0
    np.testing.assert_array_equal(np.asarray(out), want)
    ref = ragged_attention_reference(jnp.ones((rows, 1, d), jnp.float32), k_flat, v_flat,
                                     jnp.int32(0), jnp.arange(rows, dtype=jnp.int32),
                                     jnp.zeros(rows, jnp.int32),
                                     jnp.arange(rows, dtype=jnp.int32)[:, None],
                                     num_blocks=rows, block_size=bs, scale=0.125)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.asarray(ref)[finite], want[finite])


def test_cpu_kernel_reads_the_layer_it_is_given():
    case, flat, _ = flat_and_padded(7, [3, 1], [20, 40], 3, 64, 16, padding=0)
    for layer in (0, 1):
        args = list(flat.args())
        args[3] = jnp.int32(layer)
        out = ragged_attention(*args, **flat.kw())
        ref = ragged_attention_reference(*args, **flat.kw())
        assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("change,match", [
    (dict(q=jnp.zeros((4, 9, 64))), r"must be int32 \[T=4\]"),
    (dict(token_rows=jnp.asarray([0, 0, 1, 5, -1], jnp.int32)),
     r"token_rows must lie in \[-1, R=2\)"),
    (dict(positions=jnp.asarray([0, 1, 0, 4096, 0], jnp.int32)), r"positions of real tokens"),
    (dict(block_tables=jnp.full((2, 4), 999, jnp.int32)), r"ids outside \[0, 12\)"),
    (dict(q=jnp.zeros((5, 10, 64))), r"H must be a multiple of KVH"),
])
def test_bad_inputs_name_the_value(change, match):
    rng = np.random.default_rng(0)
    base = dict(q=jnp.asarray(rng.standard_normal((5, 9, 64)), jnp.float32),
                k_flat=jnp.zeros((2 * 12 * 16, 3, 64)), v_flat=jnp.zeros((2 * 12 * 16, 3, 64)),
                layer=jnp.int32(0), token_rows=jnp.asarray([0, 0, 1, 1, -1], jnp.int32),
                positions=jnp.asarray([0, 1, 0, 1, 0], jnp.int32),
                block_tables=jnp.ones((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=match):
        ragged_attention(**{**base, **change}, num_blocks=12, block_size=16, scale=0.125)
