"""One sequence, start to finish: the smallest real use of model + paged cache + tokenizer.

The prompt is prefilled in one call (padded to a power of two), then tokens are decoded one at a
time; the KV cache is donated to each call.  The engine (continuous batching) supersedes this for
serving; `xlaserve generate` and the tests use it as the plain single-request path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.models.batch_metadata import one_row_metadata
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import AttentionMetadata, KVCache, Params, forward, init_kv_cache


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


@partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("kv",))
def _step(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
          kv: KVCache, meta: AttentionMetadata, logits_index: jax.Array,
          backend: str) -> tuple[jax.Array, KVCache]:
    return forward(params, config, tokens, positions, kv, meta, logits_index=logits_index,
                   attention_backend=backend)


class SequenceGenerator:
    """Generates for one sequence at a time over a private paged cache."""

    def __init__(self, params: Params, config: ModelConfig, *, max_len: int = 2048,
                 block_size: int = 16, attention_backend: str = "auto",
                 kv_dtype: str | None = None):
        self.params = params
        self.config = config
        self.block_size = block_size
        self.width = -(-max_len // block_size)  # blocks per sequence
        self.max_len = self.width * block_size
        self.backend = attention_backend
        # block 0 is the null block; the sequence owns blocks 1..width.
        self.kv = init_kv_cache(config, self.width + 1, block_size, kv_dtype)
        self.block_table = np.arange(1, self.width + 1, dtype=np.int32)

    def _run(self, tokens: list[int], start: int, pad_to: int) -> np.ndarray:
        n = len(tokens)
        toks = np.zeros(pad_to, np.int32)
        toks[:n] = tokens
        pos, meta = one_row_metadata(self.block_table, start, n, pad_to, self.block_size)
        meta = AttentionMetadata(*(jnp.asarray(a) for a in meta))
        logits, self.kv = _step(self.params, self.config, jnp.asarray(toks), jnp.asarray(pos),
                                self.kv, meta, jnp.array([n - 1], jnp.int32), self.backend)
        return np.asarray(logits[0])

    def prefill_logits(self, tokens: list[int]) -> np.ndarray:
        """Logits after the last prompt token: [V] float32."""
        if not 0 < len(tokens) < self.max_len:
            raise ValueError(f"prompt of {len(tokens)} tokens does not fit max_len={self.max_len}")
        return self._run(tokens, 0, min(_bucket(len(tokens)), self.max_len))

    def generate(self, prompt: list[int], options: SamplingOptions,
                 stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
        rng = np.random.default_rng(options.seed)
        logits = self.prefill_logits(prompt)
        pos = len(prompt)
        for _ in range(options.max_tokens):
            token = sample(logits, options, rng)
            yield token
            if token in stop_ids or pos + 1 >= self.max_len:
                return
            logits = self._run([token], pos, 1)
            pos += 1


def sample(logits: np.ndarray, options: SamplingOptions, rng: np.random.Generator) -> int:
    if options.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / options.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if options.top_p < 1.0:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < options.top_p
        mask = np.zeros_like(p, bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(len(p), p=p))
