"""RoPE and the KV write of one layer: the native CPU kernel against the jnp reference (exact:
the same float32 products and sums), and the reference against the model's rotation written
out by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels.kv_quant import row_width
from xlaserve.kernels.rope_kv_write import (
    rope_kv_write,
    rope_kv_write_kernel,
    rope_kv_write_reference,
)
from xlaserve.models.rope import rope_tables


def make_inputs(seed: int, tokens: int, heads: int, kv_heads: int, head_dim: int,
                layers: int, rows_per_layer: int, cache_dtype=jnp.float32):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    positions = jnp.asarray(rng.integers(0, 4096, tokens), jnp.int32)
    inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim), jnp.float32)
    cos, sin = rope_tables(positions, inv_freq)
    cache = (layers * rows_per_layer, kv_heads, row_width(head_dim, cache_dtype))
    k_flat = normal(*cache).astype(cache_dtype)   # an int8 cache's "rows": any bytes will do
    v_flat = normal(*cache).astype(cache_dtype)
    return (normal(tokens, heads, head_dim), normal(tokens, kv_heads, head_dim),
            normal(tokens, kv_heads, head_dim), cos, sin, k_flat, v_flat)


# tokens (1 decode row .. a 300-token chunk, over the 32-token items), heads, kv heads, D
SHAPES = [(1, 9, 3, 64), (7, 4, 4, 32), (64, 8, 1, 128), (300, 9, 3, 64), (33, 6, 2, 80)]


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", SHAPES)
def test_kernel_matches_reference(tokens: int, heads: int, kv_heads: int, head_dim: int):
    layers, rows = 3, 512
    args = make_inputs(tokens, tokens, heads, kv_heads, head_dim, layers, rows)
    rng = np.random.default_rng(tokens + 1)
    # distinct cells, plus (when there is room) one past the cache (dropped) and one
    # negative (counted from the end, as jnp's .at[] does)
    slots = rng.permutation(rows)[:tokens].astype(np.int32)
    if tokens > 2:
        slots[-1], slots[-2] = layers * rows, -1
    for layer in (0, layers - 1):
        inputs = (*args, jnp.int32(layer), jnp.asarray(slots))
        got = jax.jit(lambda *a: rope_kv_write_kernel(*a, rows_per_layer=rows))(*inputs)
        want = jax.jit(lambda *a: rope_kv_write_reference(*a, rows_per_layer=rows))(*inputs)
        for name, g, w in zip(("q", "k_flat", "v_flat"), got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_reference_rotates_and_writes():
    """One token by hand: q and k rotated pairwise (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), k
    and v stored in layer 1's row of slot 5, nothing else of the cache touched."""
    q, k, v, cos, sin, k_flat, v_flat = make_inputs(0, 1, 2, 1, 8, 2, 16)
    out_q, out_k, out_v = rope_kv_write_reference(q, k, v, cos, sin, k_flat, v_flat,
                                                  jnp.int32(1), jnp.asarray([5], jnp.int32),
                                                  rows_per_layer=16)
    c, s = np.asarray(cos)[0], np.asarray(sin)[0]

    def by_hand(x):
        x1, x2 = x[..., :4], x[..., 4:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    np.testing.assert_allclose(out_q, by_hand(np.asarray(q)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out_k[21], by_hand(np.asarray(k)[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out_v[21], v[0])
    untouched = np.arange(32) != 21
    np.testing.assert_array_equal(out_k[untouched], k_flat[untouched])
    np.testing.assert_array_equal(out_v[untouched], v_flat[untouched])


def test_dispatch_keeps_quantized_caches_on_the_reference():
    """An int8 cache's rows (kernels/kv_quant.py) are made by the reference even when the
    kernel is asked for; a float32 cache goes to the kernel, with the same result."""
    args = make_inputs(3, 5, 4, 2, 32, 2, 64, cache_dtype=jnp.int8)
    inputs = (*args, jnp.int32(1), jnp.arange(5, dtype=jnp.int32))
    got = rope_kv_write(*inputs, rows_per_layer=64, use_kernel=True)
    want = rope_kv_write_reference(*inputs, rows_per_layer=64)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert got[1].dtype == jnp.int8


def test_kernel_names_bad_shapes():
    q, k, v, cos, sin, k_flat, v_flat = make_inputs(0, 4, 4, 2, 32, 2, 64)
    with pytest.raises(ValueError, match=r"cos and sin must be \[T=4, D/2=16\]"):
        rope_kv_write_kernel(q, k, v, cos[:, :8], sin[:, :8], k_flat, v_flat, jnp.int32(0),
                             jnp.arange(4, dtype=jnp.int32), rows_per_layer=64)
    with pytest.raises(ValueError, match=r"not a multiple of rows_per_layer=48"):
        rope_kv_write_kernel(q, k, v, cos, sin, k_flat, v_flat, jnp.int32(0),
                             jnp.arange(4, dtype=jnp.int32), rows_per_layer=48)
    with pytest.raises(ValueError, match=r"slot_mapping must be int32 \[T=4\]"):
        rope_kv_write_kernel(q, k, v, cos, sin, k_flat, v_flat, jnp.int32(0),
                             jnp.arange(3, dtype=jnp.int32), rows_per_layer=64)
