"""Whole-block gather and scatter between the device KV cache and the host
(serving/runner/kv_transfer.py), against numpy indexing, float32 and the int8 row layout."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.models.llama import KVCache
from xlaserve.serving.runner.kv_transfer import gather_blocks, padded_count, scatter_blocks


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_gather_then_scatter_round_trips(dtype):
    rng = np.random.default_rng(0)
    shape = (3, 9, 4, 2, 6)                       # [L, N, bs, K, D']
    k = rng.integers(-100, 100, shape).astype(dtype)
    v = rng.integers(-100, 100, shape).astype(dtype)
    kv = KVCache(jnp.asarray(k), jnp.asarray(v))
    gk, gv = gather_blocks(kv, [5, 2, 7])
    np.testing.assert_array_equal(gk, k[:, [5, 2, 7]])
    np.testing.assert_array_equal(gv, v[:, [5, 2, 7]])
    out = scatter_blocks(kv, [1, 3, 8], gk, gv)     # kv donated: use `out`
    want_k, want_v = k.copy(), v.copy()
    want_k[:, [1, 3, 8]], want_v[:, [1, 3, 8]] = k[:, [5, 2, 7]], v[:, [5, 2, 7]]
    np.testing.assert_array_equal(np.asarray(out.k)[:, 1:], want_k[:, 1:])   # 0: null block
    np.testing.assert_array_equal(np.asarray(out.v)[:, 1:], want_v[:, 1:])
    assert gather_blocks(out, [])[0].shape == (3, 0, 4, 2, 6)


def test_scatter_refuses_bad_blocks():
    kv = KVCache(jnp.zeros((1, 4, 2, 1, 3)), jnp.zeros((1, 4, 2, 1, 3)))
    block = np.zeros((1, 1, 2, 1, 3), np.float32)
    with pytest.raises(ValueError, match="shape"):
        scatter_blocks(kv, [1, 2], block, block)
    with pytest.raises(ValueError, match="dtype"):
        scatter_blocks(kv, [1], block.astype(np.int8), block.astype(np.int8))
    with pytest.raises(ValueError, match="distinct"):
        scatter_blocks(kv, [0], block, block)


def test_padded_counts_are_powers_of_two():
    assert [padded_count(n) for n in (0, 1, 2, 3, 4, 5, 17)] == [1, 1, 2, 4, 4, 8, 32]
