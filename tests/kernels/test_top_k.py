"""The native top-k kernel against lax.top_k: values, indices, ties (lower index first)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels.top_k import top_k, top_k_reference


@pytest.mark.parametrize("b,v,k", [(1, 10, 1), (4, 49152, 20), (32, 49152, 256), (3, 300, 300),
                                   (5, 1000, 7)])
def test_matches_lax_top_k(b, v, k):
    rng = np.random.default_rng(v + k)
    x = rng.standard_normal((b, v)).astype(np.float32)
    x[:, ::7] = np.round(x[:, ::7], 1)          # plenty of ties
    x[x == 0] = 0.0                             # no -0.0: XLA orders it below 0.0, we tie
    x = jnp.asarray(x)
    values, indices = jax.jit(lambda x: top_k(x, k))(x)
    want_v, want_i = top_k_reference(x, k)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_i))


def test_bad_k_names_the_shape():
    with pytest.raises(ValueError, match=r"1 <= k <= V, got \(2, 5\) and k=6"):
        top_k(jnp.zeros((2, 5)), 6)
