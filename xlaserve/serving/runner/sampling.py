"""Token sampling on device, one row per sequence, inside the compiled step.

Per row: penalties (as an additive bias the host builds from the row's generated-token counts),
temperature, top-k, top-p, min-p, then one draw from the filtered distribution by inverse CDF,
its uniform keyed by the row's own seed and generation index — so a seeded request produces the
same tokens whatever else is in the batch.  Greedy rows (temperature 0) take the argmax.

No full sort of the vocabulary (XLA:CPU sorts [32, 49152] floats in ~260 ms, more than the
step): rows without top-k / top-p draw from the whole (min-p cut) distribution through a
two-level CDF (block sums, then within the block); rows with them draw among the
CANDIDATES best tokens (kernels/top_k.py), exact whenever the kept set lies inside the
candidates; only a row whose set does not (top-p near 1 over a flat distribution, top-k
above CANDIDATES) sorts the whole vocabulary (with the same kernel), row by row.
Constrained rows (structured outputs) have their forbidden tokens at -inf first
(token_mask.py).  Logprobs are of the model's raw distribution, computed only in a step where
some row asks for them (the others get zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from xlaserve.kernels.top_k import top_k
from xlaserve.serving.runner.token_mask import apply_token_mask

MAX_TOP_LOGPROBS = 20
CANDIDATES = 256   # tokens a top-k / top-p row draws among without a sort
CDF_BLOCK = 128    # vocabulary entries per block of the two-level CDF


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


def _first_max(z: jax.Array) -> jax.Array:
    """argmax over the last axis, first index on ties ([B, V] -> [B] int32); two plain
    reductions, which XLA:CPU runs several times faster than its argmax."""
    v = z.shape[-1]
    m = jnp.max(z, axis=-1, keepdims=True)
    return jnp.min(jnp.where(z == m, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def uniforms(s: SamplingArrays, salt: int | None = None) -> jax.Array:
    """[B] float32 in [0, 1), one per row from its (seed, token index) stream; with `salt`, a
    stream beside it (same seed and token index), independent of the sampler's own draw (the
    accept / resample draws of draft_verify.py)."""
    def draw(seed: jax.Array, c: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), c)
        return jax.random.uniform(key if salt is None else jax.random.fold_in(key, salt))

    return jax.vmap(draw)(s.seed, s.counter)


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Index drawn with probability proportional to weights [B, N] (>= 0, a positive row
    sum), for uniforms u [B]: the first index whose running sum exceeds u x total."""
    total = jnp.sum(weights, axis=-1)
    cdf = jnp.cumsum(weights, axis=-1)
    return jnp.argmax(cdf > (u * total)[:, None], axis=-1).astype(jnp.int32)


def _draw_all(z: jax.Array, s: SamplingArrays, u: jax.Array) -> jax.Array:
    """Rows without top-k / top-p: softmax(z) cut by min-p, over the whole vocabulary.
    Two levels: the block whose cumulative mass passes u, then the token inside it."""
    b, v = z.shape
    m = jnp.max(z, axis=-1, keepdims=True)
    cut = jnp.where(s.min_p[:, None] > 0, m + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None],
                    -jnp.inf)
    w = jnp.where(z >= cut, jnp.exp(z - m), 0.0)                       # [B, V]
    pad = -v % CDF_BLOCK
    blocks = jnp.pad(w, ((0, 0), (0, pad))).reshape(b, -1, CDF_BLOCK)  # [B, V/C, C]
    mass = blocks.sum(axis=-1)                                          # [B, V/C]
    total = mass.sum(axis=-1)
    before = jnp.cumsum(mass, axis=-1) - mass
    target = u * total
    block = jnp.clip(jnp.sum(before <= target[:, None], axis=-1) - 1, 0, mass.shape[1] - 1)
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]   # [B, C]
    rest = (target - jnp.take_along_axis(before, block[:, None], axis=1)[:, 0]) / jnp.maximum(
        jnp.take_along_axis(mass, block[:, None], axis=1)[:, 0], 1e-30)
    j = _inverse_cdf(inside, jnp.clip(rest, 0.0, 1.0 - 1e-7))
    return jnp.minimum(block * CDF_BLOCK + j, v - 1)


def _cuts(sorted_z: jax.Array, lse: jax.Array, s: SamplingArrays, v: int) -> jax.Array:
    """The value every kept token reaches ([B, 1]), from the row's tokens sorted descending
    (all of them, or the best CANDIDATES): the k-th best, the smallest of the top-p prefix,
    and the min-p bound, whichever is highest."""
    n = sorted_z.shape[-1]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, v), v)
    kth = jnp.take_along_axis(sorted_z, jnp.minimum(k - 1, n - 1)[:, None], axis=-1)
    kth = jnp.where((k <= n)[:, None], kth, -jnp.inf)
    probs = jnp.exp(sorted_z - lse[:, None])        # of the whole distribution
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_p = before < s.top_p[:, None]               # the smallest prefix reaching top_p
    p_cut = jnp.min(jnp.where(keep_p, sorted_z, jnp.inf), axis=-1, keepdims=True)
    p_cut = jnp.where((s.top_p < 1.0)[:, None], p_cut, -jnp.inf)
    m_cut = sorted_z[:, :1] + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None]
    m_cut = jnp.where(s.min_p[:, None] > 0, m_cut, -jnp.inf)
    return jnp.maximum(jnp.maximum(kth, p_cut), m_cut)


def _draw_filtered(z: jax.Array, s: SamplingArrays, u: jax.Array) -> jax.Array:
    """Rows with top-k or top-p: among the best CANDIDATES tokens; a row whose kept set does
    not lie inside them (rarely) draws after a sort of the whole vocabulary."""
    b, v = z.shape
    lse = jax.nn.logsumexp(z, axis=-1)
    n = min(CANDIDATES, v)
    cand_z, cand_ids = top_k(z, n)                                      # [B, n] descending
    kept = cand_z >= _cuts(cand_z, lse, s, v)
    w = jnp.where(kept, jnp.exp(cand_z - cand_z[:, :1]), 0.0)
    drawn = jnp.take_along_axis(cand_ids, _inverse_cdf(w, u)[:, None], axis=-1)[:, 0]
    # Exact when the set stops before the last candidate (ties at the cut included), or when
    # the last candidate is already forbidden (-inf: a structured-output mask) and so is
    # every token after it.
    inside = ~kept[:, -1] | (n == v) | (cand_z[:, -1] == -jnp.inf)
    needed = ((s.top_k > 0) | (s.top_p < 1.0)) & ~inside
    return jax.lax.cond(jnp.any(needed), lambda _: _draw_sorted(z, s, u, lse, needed, drawn),
                        lambda _: drawn, None)


def _draw_sorted(z: jax.Array, s: SamplingArrays, u: jax.Array, lse: jax.Array,
                 needed: jax.Array, drawn: jax.Array) -> jax.Array:
    """The rows `needed` [B] draw over every token sorted, in the same (descending) order as
    the candidates, so a row whose set fits them would draw the same token either way; the
    others keep `drawn` [B].  One row at a time (lax.map): XLA:CPU allocates a call's
    temporaries, this branch's included, afresh on every call, whether the branch runs or
    not, and a [B, V] sort's made a 32-row greedy sampler call ~10 ms of page faults (15 ms
    against 3); a row's are 1/B of that."""
    v = z.shape[1]

    def sort(z1: jax.Array, s1: SamplingArrays, u1: jax.Array, lse1: jax.Array) -> jax.Array:
        all_z, all_ids = top_k(z1, v)                                       # [1, V]
        w = jnp.where(all_z >= _cuts(all_z, lse1, s1, v), jnp.exp(all_z - all_z[:, :1]), 0.0)
        return jnp.take_along_axis(all_ids, _inverse_cdf(w, u1)[:, None], axis=-1)[0, 0]

    return map_rows(needed, sort, drawn, (z, s, u, lse))


def map_rows(needed: jax.Array, f: Callable[..., Any], kept: Any, xs: tuple[Any, ...]) -> Any:
    """Row by row (lax.map): f(*row i of xs, each with a leading axis of 1) where needed[i]
    ([B] bool), else row i of `kept` (a pytree of [B, ...], the shape of f's result).  For the
    sampler's rare branches, whose [B, V] temporaries would otherwise cost every call."""
    def row(args: tuple[Any, ...]) -> Any:
        need, keep, x = args
        x1 = jax.tree_util.tree_map(lambda a: a[None], x)
        return jax.lax.cond(need, lambda _: f(*x1), lambda _: keep, None)

    return jax.lax.map(row, (needed, kept, xs))


def sample(logits: jax.Array, s: SamplingArrays, allowed: jax.Array | None = None
           ) -> SampleOutput:
    """logits: [B, V] float32 -> sampled tokens and logprobs (zeros unless some row of the
    step asks for them; of the model's distribution, before any mask).  allowed: [B,
    ceil(V/32)] int32 packed allowed-token mask (token_mask.py), None = every token."""
    masked = logits if allowed is None else apply_token_mask(logits, allowed)
    biased = masked + s.bias
    greedy = _first_max(biased)

    def draw(_: None) -> jax.Array:
        t = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
        z = biased / t
        u = uniforms(s)
        plain = _draw_all(z, s, u)
        filtering = (s.top_k > 0) | (s.top_p < 1.0)
        drawn = jax.lax.cond(jnp.any(filtering & (s.temperature > 0)),
                             lambda _: jnp.where(filtering, _draw_filtered(z, s, u), plain),
                             lambda _: plain, None)
        return jnp.where(s.temperature > 0, drawn, greedy).astype(jnp.int32)

    # Skip the draws entirely when every row is greedy.
    tokens = jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda _: greedy, None)
    b = logits.shape[0]

    def with_logprobs(_: None) -> tuple[jax.Array, jax.Array, jax.Array]:
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = top_k(logprobs, MAX_TOP_LOGPROBS)
        chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lp

    def without(_: None) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.zeros((b,), jnp.float32), jnp.zeros((b, MAX_TOP_LOGPROBS), jnp.int32),
                jnp.zeros((b, MAX_TOP_LOGPROBS), jnp.float32))

    wanted = jnp.bool_(True) if s.logprobs is None else jnp.any(s.logprobs)
    chosen, top_ids, top_lp = jax.lax.cond(wanted, with_logprobs, without, None)
    return SampleOutput(tokens, chosen, top_ids, top_lp)
