"""Asking for huge pages leaves the buffers' contents as they were (and is a no-op where the
kernel refuses)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.cpu import huge_pages


def test_advise_keeps_contents():
    rng = np.random.default_rng(0)
    host = rng.standard_normal((3, 1 << 20)).astype(np.float32)   # 12 MiB: several 2 MiB spans
    tree = {"a": jnp.asarray(host), "b": [jnp.arange(10)]}
    spans = huge_pages.advise(tree)
    assert spans >= 0
    np.testing.assert_array_equal(np.asarray(tree["a"]), host)
    np.testing.assert_array_equal(np.asarray(tree["b"][0]), np.arange(10))
