"""The device sampler on synthetic logits: each filter keeps exactly the tokens it should."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.serving.runner.sampling import SamplingArrays, sample

V = 32
# probabilities 0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02 then ~0
PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02] + [1e-9] * (V - 7))
LOGITS = np.log(PROBS).astype(np.float32)


def _arrays(rows: int, **kw) -> SamplingArrays:
    def col(name: str, default, dtype):
        return jnp.asarray(np.full(rows, kw.get(name, default), dtype))

    return SamplingArrays(col("temperature", 1.0, np.float32), col("top_k", 0, np.int32),
                          col("top_p", 1.0, np.float32), col("min_p", 0.0, np.float32),
                          jnp.arange(rows, dtype=jnp.uint32) + kw.get("seed", 0),
                          col("counter", 0, np.int32), jnp.zeros((rows, V), jnp.float32),
                          col("logprobs", True, np.bool_))


_sample = jax.jit(sample)


def _support(**kw) -> set[int]:
    rows = 512
    out = _sample(jnp.tile(LOGITS, (rows, 1)), _arrays(rows, **kw))
    return set(np.asarray(out.tokens).tolist())


@pytest.mark.parametrize("kw, expected", [
    (dict(top_k=1), {0}),
    (dict(top_k=3), {0, 1, 2}),
    (dict(top_p=0.5), {0, 1}),            # 0.4 < 0.5, 0.4 + 0.25 reaches it
    (dict(top_p=0.8), {0, 1, 2, 3}),
    (dict(min_p=0.3), {0, 1, 2}),         # p >= 0.3 * 0.4 = 0.12
    (dict(top_k=3, top_p=0.5), {0, 1}),
    (dict(temperature=0.0), {0}),
])
def test_filters_keep_exactly_their_tokens(kw, expected) -> None:
    assert _support(**kw) == expected


def test_full_distribution_is_followed() -> None:
    rows = 4096
    out = _sample(jnp.tile(LOGITS, (rows, 1)), _arrays(rows))
    freq = np.bincount(np.asarray(out.tokens), minlength=V) / rows
    assert np.abs(freq[:4] - PROBS[:4]).max() < 0.03


def test_same_seed_same_token_whatever_the_row() -> None:
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((8, V)), jnp.float32)
    a = _arrays(8, seed=5)
    one = _sample(logits[3:4], a._replace(**{f: getattr(a, f)[3:4] for f in a._fields}))
    many = _sample(logits, a)
    assert int(one.tokens[0]) == int(many.tokens[3])


def test_logprobs_only_when_a_row_asks() -> None:
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, V)), jnp.float32)
    asked = _sample(logits, _arrays(4, temperature=0.0))
    not_asked = _sample(logits, _arrays(4, temperature=0.0, logprobs=False))
    np.testing.assert_array_equal(np.asarray(asked.tokens), np.asarray(not_asked.tokens))
    assert np.all(np.asarray(not_asked.top_logprobs) == 0) and np.all(
        np.asarray(not_asked.logprob) == 0)
    assert np.all(np.asarray(asked.logprob) < 0)


def test_logprobs_and_bias() -> None:
    arr = _arrays(1, temperature=0.0)
    bias = jnp.zeros((1, V)).at[0, 0].set(-100.0)   # a penalty pushes the best token out
    out = _sample(jnp.asarray(LOGITS)[None], arr._replace(bias=bias))
    assert int(out.tokens[0]) == 1
    np.testing.assert_allclose(np.exp(np.asarray(out.top_logprobs[0, :3])), PROBS[:3],
                               rtol=1e-5)
    assert abs(float(out.logprob[0]) - np.log(PROBS[1])) < 1e-5  # raw, unbiased logprob


def _kept_set(logits: np.ndarray, top_k: int = 0, top_p: float = 1.0) -> set[int]:
    """The tokens a filter keeps, by a full sort in numpy (ties at the cut kept)."""
    order = np.argsort(-logits, kind="stable")
    z = logits[order]
    p = np.exp(z - z.max())
    p /= p.sum()
    cut = -np.inf
    if top_k:
        cut = max(cut, z[top_k - 1])
    if top_p < 1.0:
        before = np.cumsum(p) - p
        cut = max(cut, z[before < top_p].min())
    return {int(i) for i in np.flatnonzero(logits >= cut)}


@pytest.mark.parametrize("shape,kw", [
    ("peaked", dict(top_k=5)), ("peaked", dict(top_p=0.5)), ("peaked", dict(top_p=0.9)),
    ("flat", dict(top_p=0.5)),     # the kept set spills past the candidates: the sorted path
    ("flat", dict(top_k=300)),     # top-k above the candidates: the sorted path
])
def test_filters_over_a_large_vocabulary_keep_exactly_their_tokens(shape, kw):
    """V = 1000: the best-256 candidate path where the kept set fits in it, the sorted path
    where it does not; either way every draw lies in the exact set, and draws cover it."""
    v, rows = 1000, 2048
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(v).astype(np.float32) * (4.0 if shape == "peaked" else 0.3)
    want = _kept_set(logits, **kw)
    arrays = _arrays(rows, **kw)._replace(bias=jnp.zeros((rows, v), jnp.float32))
    out = _sample(jnp.tile(jnp.asarray(logits), (rows, 1)), arrays)
    got = set(np.asarray(out.tokens).tolist())
    assert got <= want
    if len(want) <= 64:
        assert got == want


def test_top_p_row_draws_the_same_whether_or_not_a_wide_row_shares_the_step() -> None:
    """A row whose top-p set fits the candidates draws the same token when another row of the
    step needs the whole sorted vocabulary (the step then takes the sorted branch)."""
    from xlaserve.serving.runner.sampling import CANDIDATES

    v, rows = 2 * CANDIDATES, 64
    rng = np.random.default_rng(1)
    peaked = rng.standard_normal((rows, v)).astype(np.float32) * 4     # sets fit: ~10 tokens
    flat = np.zeros((rows, v), np.float32)                             # 0.99 of it: ~500

    def arrays(top_p: np.ndarray) -> SamplingArrays:
        return SamplingArrays(jnp.ones(rows), jnp.zeros(rows, jnp.int32), jnp.asarray(top_p),
                              jnp.zeros(rows), jnp.arange(rows, dtype=jnp.uint32) + 9,
                              jnp.arange(rows, dtype=jnp.int32), jnp.zeros((rows, v)))

    alone = _sample(jnp.asarray(peaked), arrays(np.full(rows, 0.9, np.float32)))
    mixed_logits = np.where((np.arange(rows) % 2 == 1)[:, None], flat, peaked)
    top_p = np.where(np.arange(rows) % 2 == 1, 0.99, 0.9).astype(np.float32)
    mixed = _sample(jnp.asarray(mixed_logits), arrays(top_p))
    assert np.array_equal(np.asarray(mixed.tokens)[::2], np.asarray(alone.tokens)[::2])
