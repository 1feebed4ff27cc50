"""The allowed-token mask of constrained rows (structured outputs), packed 32 tokens to an
int32 word: bit t % 32 of word t // 32 set = token t may be sampled.

    host  GrammarState.fill -> mask [R, ceil(V/32)] int32   (unconstrained rows: all bits set)
    device  apply_token_mask(logits [R, V], mask) -> logits with the forbidden tokens at -inf,
            in the sampler, before penalties' bias, temperature and the draws

One shape per row bucket, so nothing compiles after warm-up; a step whose rows are all
unconstrained sends no mask (the runner keeps an all-set one per row count on device).  The
sampler applies the mask always, as one select XLA fuses with the bias add: cheaper than a
`lax.cond` that would skip it for all-set masks (BENCHMARKS.md, "Structured outputs": the
cond cost ~20% of the sampler, the fused select nothing measurable).  On a multi-host mesh the
mask travels folded into the bias (`mask_as_bias`): the step channel carries it already.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ALL_ALLOWED = -1   # an int32 word with every bit set


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def all_allowed(rows: int, vocab_size: int) -> np.ndarray:
    """[rows, ceil(V/32)] int32, every token allowed."""
    return np.full((rows, mask_words(vocab_size)), ALL_ALLOWED, np.int32)


def unpack(mask: np.ndarray | jax.Array, vocab_size: int):
    """[R, W] int32 words -> [R, V] bool (host numpy or device jnp alike)."""
    xp = jnp if isinstance(mask, jax.Array) else np
    bits = (mask[:, :, None] >> xp.arange(32, dtype=xp.int32)) & 1       # [R, W, 32]
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size] != 0          # [R, V]


def mask_as_bias(mask: np.ndarray, bias: np.ndarray | None, vocab_size: int) -> np.ndarray:
    """The mask [R, W] folded into an additive bias [R, V] float32 (-inf where forbidden)."""
    out = np.zeros((mask.shape[0], vocab_size), np.float32) if bias is None else bias.copy()
    out[~unpack(mask, vocab_size)] = -np.inf
    return out


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [R, V] float32, mask [R, ceil(V/32)] int32 -> logits, -inf where the mask's bit
    is clear."""
    return jnp.where(unpack(mask, logits.shape[-1]), logits, -jnp.inf)
