"""The tiled grouped SwiGLU against its ragged_dot reference on random shapes: empty groups,
rows past the groups' total (another shard's pairs), every tile size, a layer of a stack; and
the wrapper's refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels.grouped_swiglu import (
    grouped_swiglu,
    grouped_swiglu_reference,
    grouped_swiglu_tiled,
    tile_for,
)


def case(seed: int, m: int, groups: int, e: int = 24, f: int = 40, layers: int = 3):
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.ones(groups) * 0.5))
    x = rng.standard_normal((m, e)).astype(np.float32)
    w = [rng.standard_normal(s).astype(np.float32) * 0.3
         for s in ((layers, groups, e, f), (layers, groups, e, f), (layers, groups, f, e))]
    return jnp.asarray(x), [jnp.asarray(a) for a in w], jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("seed,m,groups", [(0, 1, 4), (1, 8, 8), (2, 37, 4), (3, 128, 8),
                                           (4, 300, 6), (5, 16, 1)])
@pytest.mark.parametrize("tile", [1, 2, 8, 64])
def test_tiled_matches_ragged_dot(seed: int, m: int, groups: int, tile: int) -> None:
    x, (wg, wu, wd), sizes = case(seed, m, groups)
    layer = jnp.int32(seed % 3)
    want = np.asarray(grouped_swiglu_reference(x, wg, wu, wd, sizes, layer))
    got = np.asarray(jax.jit(grouped_swiglu_tiled, static_argnums=6)(x, wg, wu, wd, sizes,
                                                                      layer, tile))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    total = int(sizes.sum())
    assert not got[total:].any()              # rows past the groups' total stay zero
    if total:
        assert np.abs(got[:total]).max() > 0


def test_skewed_and_empty_groups() -> None:
    """Every row in one expert (the others empty), and no rows at all."""
    x, (wg, wu, wd), _ = case(7, 20, 4)
    for sizes in ([0, 20, 0, 0], [0, 0, 0, 0], [0, 0, 0, 13]):
        s = jnp.asarray(sizes, jnp.int32)
        want = grouped_swiglu_reference(x, wg, wu, wd, s, 1)
        got = grouped_swiglu(x, wg, wu, wd, s, 1)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_tile_follows_rows_per_expert() -> None:
    assert [tile_for(m, 8) for m in (2, 8, 16, 100, 512, 4096)] == [1, 1, 2, 8, 64, 64]


def test_wrapper_refuses_bad_shapes() -> None:
    x, (wg, wu, wd), sizes = case(0, 8, 4)
    with pytest.raises(ValueError, match=r"w_gate has shape \(4, 24, 40\), expected the "
                                         r"stacked \[L, G, E, F\]"):
        grouped_swiglu(x, wg[0], wu[0], wd[0], sizes)
    with pytest.raises(ValueError, match=r"w_down \(3, 4, 24, 40\)"):
        grouped_swiglu(x, wg, wu, wg, sizes)
    with pytest.raises(ValueError, match=r"sizes has shape \(3,\), expected \(4,\)"):
        grouped_swiglu(x, wg, wu, wd, sizes[:3])
    with pytest.raises(ValueError, match=r"backend 'pallas'"):
        grouped_swiglu(x, wg, wu, wd, sizes, backend="pallas")
