"""One sequence, greedy, start to finish: model + paged cache and nothing else, the oracle the
engine's tests (and `bench quality`) compare continuous batching against.

The prompt is prefilled in one call (padded to a power of two), then tokens are decoded one at a
time; the KV cache is donated to each call.  Only greedy: sampling is the runner's alone
(serving/runner/sampling.py), which `xlaserve generate` (serving/generate.py) uses through the
engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.models.batch_metadata import one_row_metadata
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import AttentionMetadata, KVCache, Params, forward, init_kv_cache


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

    def generate(self, prompt: list[int], max_tokens: int,
                 stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
        """The greedy continuation of `prompt`, up to `max_tokens` tokens (a stop id ends it,
        yielded)."""
        logits = self.prefill_logits(prompt)
        pos = len(prompt)
        for _ in range(max_tokens):
            token = int(np.argmax(logits))
            yield token
            if token in stop_ids or pos + 1 >= self.max_len:
                return
            logits = self._run([token], pos, 1)
            pos += 1
