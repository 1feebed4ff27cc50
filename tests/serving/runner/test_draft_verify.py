"""The dense distribution a row samples from (distribution.py) is what `sample` draws, for
every filter; and accept-or-resample (draft_verify.py) turns drafts drawn from any q into
tokens distributed as p, accepting at the optimal rate sum(min(p, q))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.serving.runner.distribution import filtered_probs
from xlaserve.serving.runner.draft_verify import verify_drafts
from xlaserve.serving.runner.sampling import SamplingArrays, sample

V = 40
N = 20000
LOGITS = np.random.default_rng(0).normal(0, 1.5, V).astype(np.float32)


def arrays(n: int, **kw) -> SamplingArrays:
    def col(name: str, default, dtype):
        return jnp.asarray(np.full(n, kw.get(name, default), dtype))

    return SamplingArrays(col("temperature", 1.0, np.float32), col("top_k", 0, np.int32),
                          col("top_p", 1.0, np.float32), col("min_p", 0.0, np.float32),
                          jnp.full(n, 7, jnp.uint32), jnp.arange(n, dtype=jnp.int32),
                          jnp.zeros((n, V), jnp.float32), None)


def histogram(tokens: jax.Array) -> np.ndarray:
    return np.bincount(np.asarray(tokens), minlength=V) / tokens.shape[0]


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7), dict(top_k=5),
                                dict(top_p=0.8, temperature=1.3), dict(min_p=0.1),
                                dict(top_k=12, top_p=0.9, min_p=0.02), dict(temperature=0.0)])
def test_filtered_probs_is_what_sample_draws(kw) -> None:
    s = arrays(N, **kw)
    logits = jnp.tile(jnp.asarray(LOGITS), (N, 1))
    p = np.asarray(jax.jit(filtered_probs)(logits, s))[0]            # every row the same
    assert p.sum() == pytest.approx(1.0, abs=1e-5)
    drawn = histogram(jax.jit(sample)(logits, s).tokens)
    assert set(np.flatnonzero(drawn)) <= set(np.flatnonzero(p > 0))   # never outside
    assert 0.5 * np.abs(drawn - p).sum() < 0.02, (drawn, p)           # total variation


def test_accept_or_resample_gives_p_whatever_q() -> None:
    rng = np.random.default_rng(1)
    s = arrays(N, temperature=1.0)
    logits = jnp.tile(jnp.asarray(LOGITS), (N, 1))
    p = np.asarray(filtered_probs(logits[:1], arrays(1)))[0]
    q = rng.dirichlet(np.full(V, 0.5)).astype(np.float32)             # far from p
    drafts = rng.choice(V, size=N, p=q / q.sum()).astype(np.int32)    # d ~ q
    out = jax.jit(lambda lg, d, qq: verify_drafts(lg, s, None, sample(lg, s), d, qq))(
        logits, jnp.asarray(drafts), jnp.tile(jnp.asarray(q), (N, 1)))
    tokens = np.asarray(out.tokens)
    assert 0.5 * np.abs(histogram(out.tokens) - p).sum() < 0.02
    accepted = float((tokens == drafts).mean())
    assert accepted == pytest.approx(float(np.minimum(p, q).sum()), abs=0.015)
    # rows without a draft (-1) keep the plain draw
    plain = jax.jit(lambda lg, d, qq: verify_drafts(lg, s, None, sample(lg, s), d, qq))(
        logits, jnp.full(N, -1, jnp.int32), jnp.zeros((N, V), jnp.float32))
    assert np.array_equal(np.asarray(plain.tokens), np.asarray(sample(logits, s).tokens))
