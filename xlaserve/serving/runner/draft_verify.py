"""Standard speculative sampling for drafts drawn from a real distribution q (a draft model
sampling at temperature > 0), on device, in the verify step's sampler.

For a sample row verifying draft d ~ q with target distribution p (distribution.py):

    accept d       with probability min(1, p(d) / q(d))          (u_a x q(d) < p(d))
    else draw      from the residual max(0, p - q), renormalised  (u_b, inverse CDF)

so the token it emits is distributed as p exactly (Leviathan et al. 2023, Chen et al. 2023).
A rejected draw never equals d (the residual is 0 wherever p < q), so the host's rule
(speculative/acceptance.py: keep drafts while the sample equals them) reads the outcome the
same way as for n-gram drafts.  Rows with draft_token -1 (no draft, the bonus position, a
point-mass draft, greedy rows) keep the sampler's own token: a point mass q = 1{d} makes the
rule "draw from p, accept iff it is d", which is what the plain draw already does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.serving.runner.distribution import filtered_probs
from xlaserve.serving.runner.sampling import (
    SampleOutput,
    SamplingArrays,
    _inverse_cdf,
    map_rows,
    uniforms,
)

ACCEPT_SALT = 0x61636370     # "accp": the acceptance uniform's stream
RESIDUAL_SALT = 0x72657364   # "resd": the residual draw's


def verify_drafts(logits: jax.Array, s: SamplingArrays, allowed: jax.Array | None,
                  out: SampleOutput, draft_token: jax.Array, draft_probs: jax.Array
                  ) -> SampleOutput:
    """logits: [B, V]; out: the plain draw of every row; draft_token: [B] int32 (-1: none);
    draft_probs: [B, V] q of the rows with a draft.  Returns `out` with the tokens (and
    their logprobs) of the draft rows replaced by the accept-or-resample outcome.  Row by row
    (lax.map): the [B, V] temporaries of a batched branch would be allocated on every call
    of the sampler, taken or not (sampling._draw_sorted says what that costs)."""
    has = (draft_token >= 0) & (s.temperature > 0)
    wanted = jnp.ones_like(has) if s.logprobs is None else s.logprobs

    def resolved(logits1: jax.Array, s1: SamplingArrays, allowed1: jax.Array | None,
                 q1: jax.Array, d1: jax.Array, wanted1: jax.Array, lp1: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
        token, lp = _resolve(logits1, s1, allowed1, q1, d1)
        return token, jnp.where(wanted1[0], lp, lp1[0])

    def resolve(_: None) -> SampleOutput:
        tokens, logprob = map_rows(has, resolved, (out.tokens, out.logprob),
                                   (logits, s, allowed, draft_probs, draft_token, wanted,
                                    out.logprob))
        return out._replace(tokens=tokens, logprob=logprob)

    return jax.lax.cond(jnp.any(has), resolve, lambda _: out, None)


def _resolve(logits: jax.Array, s: SamplingArrays, allowed: jax.Array | None,
             draft_probs: jax.Array, draft_token: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One draft row ([1, V] / [1]): its token (the accepted draft or the residual draw) and
    that token's logprob, as [] scalars."""
    p = filtered_probs(logits, s, allowed)                              # [1, V]
    d = jnp.maximum(draft_token, 0)[:, None]                            # [1, 1]
    p_d = jnp.take_along_axis(p, d, axis=-1)[:, 0]
    q_d = jnp.take_along_axis(draft_probs, d, axis=-1)[:, 0]
    accept = uniforms(s, ACCEPT_SALT) * q_d < p_d
    residual = jnp.maximum(p - draft_probs, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)
    redrawn = _inverse_cdf(residual, uniforms(s, RESIDUAL_SALT))
    tokens = jnp.where(accept, draft_token, redrawn).astype(jnp.int32)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)
    return tokens[0], lp[0, 0]
