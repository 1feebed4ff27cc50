"""Small helpers shared by tests: run the model over one sequence, compare logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.models.batch_metadata import one_row_metadata
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import AttentionMetadata, Params, forward, init_kv_cache


def full_logits(params: Params, config: ModelConfig, ids: list[int], block_size: int = 16,
                chunk: int | None = None, backend: str = "reference") -> np.ndarray:
    """Teacher-forced logits [T, V] for one sequence, prefilled in chunks of `chunk` tokens
    (default: all at once) through the paged cache."""
    t = len(ids)
    chunk = chunk or t
    width = -(-t // block_size)
    kv = init_kv_cache(config, width + 1, block_size)
    table = np.arange(1, width + 1, dtype=np.int32)
    step = jax.jit(lambda p, tok, pos, kv, meta: forward(p, config, tok, pos, kv, meta,
                                                          attention_backend=backend))
    out = []
    for start in range(0, t, chunk):
        piece = ids[start:start + chunk]
        n = len(piece)
        pos, meta = one_row_metadata(table, start, n, n, block_size)
        meta = AttentionMetadata(*(jnp.asarray(a) for a in meta))
        logits, kv = step(params, jnp.asarray(piece, jnp.int32), jnp.asarray(pos), kv, meta)
        out.append(np.asarray(logits))
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
