"""The distribution a row's token is drawn from, as a dense vector: what `sampling.sample`
draws from without materialising it.

    logits [B, V] -> mask, + bias, / temperature -> cut (top-k, top-p, min-p: the same
    `_cuts` the sampler applies) -> softmax over the kept tokens     [B, V], rows sum to 1
    greedy rows (temperature 0): the one-hot of their argmax

Speculative sampling with a draft model needs both sides of it: the draft's q (what its
drafts were drawn from, draft_runner.py) and the target's p (accept with min(1, p/q), else
draw from max(0, p - q): draft_verify.py).  A step whose top-k / top-p rows all keep tokens
inside the best CANDIDATES cuts among those; otherwise it sorts the whole vocabulary, as the
sampler does, so both always agree on the kept set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.kernels.top_k import top_k
from xlaserve.serving.runner.sampling import CANDIDATES, SamplingArrays, _cuts, _first_max
from xlaserve.serving.runner.token_mask import apply_token_mask


def filtered_probs(logits: jax.Array, s: SamplingArrays, allowed: jax.Array | None = None
                   ) -> jax.Array:
    """logits: [B, V] float32 (allowed: [B, ceil(V/32)] int32 or None) -> [B, V] float32, the
    probabilities `sample` draws each row's token with."""
    masked = logits if allowed is None else apply_token_mask(logits, allowed)
    biased = masked + s.bias
    b, v = logits.shape
    z = biased / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    m = jnp.max(z, axis=-1, keepdims=True)
    min_p_cut = jnp.where(s.min_p[:, None] > 0,
                          m + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None], -jnp.inf)
    filtering = ((s.top_k > 0) | (s.top_p < 1.0)) & (s.temperature > 0)

    def filtered_cut(_: None) -> jax.Array:                      # [B, 1]
        lse = jax.nn.logsumexp(z, axis=-1)
        n = min(CANDIDATES, v)
        cand_z = top_k(z, n)[0]                                   # [B, n] descending
        cut = _cuts(cand_z, lse, s, v)
        inside = (cand_z[:, -1:] < cut) | (n == v) | (cand_z[:, -1:] == -jnp.inf)
        return jax.lax.cond(jnp.all(inside | ~filtering[:, None]), lambda _: cut,
                            lambda _: _cuts(top_k(z, v)[0], lse, s, v), None)

    cut = jax.lax.cond(jnp.any(filtering), filtered_cut, lambda _: min_p_cut, None)
    cut = jnp.where(filtering[:, None], cut, min_p_cut)
    w = jnp.where(z >= cut, jnp.exp(z - m), 0.0)                  # [B, V]
    probs = w / jnp.sum(w, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(_first_max(biased), v, dtype=jnp.float32)
    return jnp.where((s.temperature > 0)[:, None], probs, one_hot)
