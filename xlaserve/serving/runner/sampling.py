"""Token sampling on device, one row per sequence, inside the compiled step.

Per row: penalties (as an additive bias the host builds from the row's generated-token counts),
temperature, top-k, top-p, min-p, then a Gumbel-max draw keyed by the row's own seed and
generation index — so a seeded request produces the same tokens whatever else is in the batch.
Greedy rows (temperature 0) take the argmax.  Logprobs are of the model's raw distribution,
computed only in a step where some row asks for them (a log-softmax and a top-20 over the
whole vocabulary per row cost as much as the rest of the sampler; the others get zeros).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

MAX_TOP_LOGPROBS = 20


class SamplingArrays(NamedTuple):
    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array        # [B] int32, 0 = off
    top_p: jax.Array        # [B] float32, 1 = off
    min_p: jax.Array        # [B] float32, 0 = off
    seed: jax.Array         # [B] uint32
    counter: jax.Array      # [B] int32: index of the token being generated (RNG stream position)
    bias: jax.Array         # [B, V] float32 additive logit bias (presence/frequency penalties)
    logprobs: jax.Array | None = None  # [B] bool: the row wants logprobs; None = every row


class SampleOutput(NamedTuple):
    tokens: jax.Array       # [B] int32
    logprob: jax.Array      # [B] float32, of the sampled token
    top_ids: jax.Array      # [B, MAX_TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [B, MAX_TOP_LOGPROBS] float32


def _row_keys(seed: jax.Array, counter: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed, counter)


def _filtered(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Temperature-scaled logits [B, V] with top-k / top-p / min-p cuts applied (-inf)."""
    v = logits.shape[-1]
    t = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    z = logits / t
    sorted_z = jnp.sort(z, axis=-1)[:, ::-1]                            # [B, V] descending
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, v), v)
    kth = jnp.take_along_axis(sorted_z, (k - 1)[:, None], axis=-1)      # [B, 1]
    probs = jax.nn.softmax(sorted_z, axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (always the first token).
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_p = before < s.top_p[:, None]
    p_cut = jnp.min(jnp.where(keep_p, sorted_z, jnp.inf), axis=-1, keepdims=True)
    # min-p: drop tokens whose probability is below min_p times the top token's.
    m_cut = sorted_z[:, :1] + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None]
    m_cut = jnp.where(s.min_p[:, None] > 0, m_cut, -jnp.inf)
    cut = jnp.maximum(jnp.maximum(kth, p_cut), m_cut)
    return jnp.where(z >= cut, z, -jnp.inf)


def sample(logits: jax.Array, s: SamplingArrays) -> SampleOutput:
    """logits: [B, V] float32 -> sampled tokens and logprobs (zeros unless some row of the
    step asks for them)."""
    biased = logits + s.bias
    greedy = jnp.argmax(biased, axis=-1).astype(jnp.int32)

    def draw(_: None) -> jax.Array:
        z = _filtered(biased, s)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, z.shape[-1:]))(
            _row_keys(s.seed, s.counter))
        drawn = jnp.argmax(z + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(s.temperature > 0, drawn, greedy)

    # Skip the sort and the noise entirely when every row is greedy.
    tokens = jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda _: greedy, None)
    b = logits.shape[0]

    def with_logprobs(_: None) -> tuple[jax.Array, jax.Array, jax.Array]:
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(logprobs, MAX_TOP_LOGPROBS)
        chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lp

    def without(_: None) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.zeros((b,), jnp.float32), jnp.zeros((b, MAX_TOP_LOGPROBS), jnp.int32),
                jnp.zeros((b, MAX_TOP_LOGPROBS), jnp.float32))

    wanted = jnp.bool_(True) if s.logprobs is None else jnp.any(s.logprobs)
    chosen, top_ids, top_lp = jax.lax.cond(wanted, with_logprobs, without, None)
    return SampleOutput(tokens, chosen, top_ids, top_lp)
