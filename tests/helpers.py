"""Small helpers shared by tests: run the model over one sequence, compare logits."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.models.batch_metadata import one_row_metadata
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import (
    AttentionMetadata,
    KVCache,
    Params,
    forward,
    init_kv_cache,
)


@partial(jax.jit, static_argnames=("config", "backend"))
def _forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
             kv: KVCache, meta: AttentionMetadata, backend: str) -> tuple[jax.Array, KVCache]:
    return forward(params, config, tokens, positions, kv, meta, attention_backend=backend)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def full_logits(params: Params, config: ModelConfig, ids: list[int], block_size: int = 16,
                chunk: int | None = None, backend: str = "reference",
                kv_dtype: str | None = None) -> np.ndarray:
    """Teacher-forced logits [T, V] for one sequence, prefilled in chunks of `chunk` tokens
    (default: all at once) through the paged cache.

    Shapes are bucketed as the engine's are, so that sequences of many lengths share a few
    compiled programs: each chunk is padded to a power of two (at least 16) tokens (padding
    tokens write to the null block 0 and their logits are dropped) and the block table to a
    power-of-two width (the attention masks keys past the sequence).  `kv_dtype`: the cache's
    ("int8", "bfloat16", ...; default the model's dtype)."""
    t = len(ids)
    chunk = chunk or t
    width = _pow2(-(-t // block_size))
    kv = init_kv_cache(config, width + 1, block_size, kv_dtype)
    table = np.arange(1, width + 1, dtype=np.int32)
    out = []
    for start in range(0, t, chunk):
        piece = ids[start:start + chunk]
        n = len(piece)
        pad_to = n if n == 1 else max(16, _pow2(n))
        tokens = np.zeros(pad_to, np.int32)
        tokens[:n] = piece
        pos, meta = one_row_metadata(table, start, n, pad_to, block_size)
        meta = AttentionMetadata(*(jnp.asarray(a) for a in meta))
        logits, kv = _forward(params, config, jnp.asarray(tokens), jnp.asarray(pos), kv, meta,
                              backend)
        out.append(np.asarray(logits[:n]))
    return np.concatenate(out)


def max_rel_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| over max |ref|: the error relative to the logits' scale."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def finish_gguf(writer, extra: dict[str, np.ndarray] | None = None) -> None:
    """Add the `extra` tensors to a gguf.GGUFWriter, write the file out and close it."""
    for name, t in (extra or {}).items():
        writer.add_tensor(name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
