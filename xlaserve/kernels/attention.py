"""Attention backend dispatch: the model's one call site, the backend chosen by config/platform.

    attention(q [T, H, D], k_flat, v_flat, layer, token_rows [T], positions [T], block_tables)
      every token of the step, flat (ragged_attention.py has the semantics)

Backends:
    reference  pure jnp (ragged_attention_reference), runs everywhere; defines the semantics
    cpu        the native CPU kernels through XLA's FFI (kernels/cpu/): ragged attention here,
               and the weight matmuls (models/llama.py asks `resolve_backend`); float32 on CPU
    pallas     the Pallas kernels; compiled through Triton on GPU, interpret=True on CPU.
               They take rows, not a flat batch: a step whose tokens are one per row
               (T == R, token r in row r: decode) runs the decode kernel; any other is cut
               into pieces of at most PIECE consecutive tokens of one row (at most
               T / PIECE + R of them), which the prefill kernel runs as rows of PIECE query
               slots: padding stays below PIECE slots a row, whatever the batch holds
    triton     the jax-triton decode kernel (GPU only); other steps use the Pallas prefill kernel
    auto       the best available on this platform (see `resolve_backend`)
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from xlaserve.kernels import paged_attention as decode_op
from xlaserve.kernels import prefill_attention as prefill_op
from xlaserve.kernels import ragged_attention as ragged_op
from xlaserve.kernels.cpu import build
from xlaserve.kernels.kv_quant import has_row_scales

BACKENDS = ("reference", "cpu", "pallas", "triton", "auto")
PIECE = 16   # query tokens per row of the Pallas prefill kernel for a flat batch


def jax_triton_available() -> bool:
    return importlib.util.find_spec("jax_triton") is not None


def check_model_backend(config: Any, backend: str) -> None:
    """Refuse, by name, a resolved backend that cannot run every layer of `config` (a
    ModelConfig): at start-up, not as a wrong answer later."""
    if backend == "triton" and any(w is not None for w in config.layer_windows):
        raise ValueError(f"attention_backend 'triton' has no sliding-window decode, which this "
                         f"{config.architecture} model's layers use (sliding_window="
                         f"{config.sliding_window}); use 'pallas' or 'auto'")


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """The concrete backend for `backend` on `platform` (default: jax's default backend)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    platform = platform or jax.default_backend()
    on_gpu = platform in ("gpu", "cuda", "rocm")
    if backend == "auto":
        # CPU: the native kernels when they built, else the jnp reference (Pallas interpret
        # mode runs the grid program by program and exists to test the kernels).  GPU: the
        # Pallas kernels, which cover decode and prefill; `triton` stays an explicit choice
        # until the H200 table (BENCHMARKS.md) shows it ahead.
        if on_gpu:
            return "pallas"
        return "cpu" if platform == "cpu" and build.load() is not None else "reference"
    if backend == "cpu":
        if platform != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU platform, not "
                             f"{platform!r}")
        if build.load() is None:
            raise ValueError(f"attention_backend 'cpu' is not available: the CPU kernels did "
                             f"not build ({build.load_error()})")
    if backend == "pallas" and platform not in ("cpu", "gpu", "cuda"):
        raise ValueError(f"attention_backend 'pallas' is not available on platform "
                         f"{platform!r}: its kernels lower through Triton (GPU) or run "
                         f"interpreted on CPU")
    if backend == "triton":
        if not on_gpu:
            raise ValueError(f"attention_backend 'triton' is not available on platform "
                             f"{platform!r}: jax-triton needs a GPU")
        if not jax_triton_available():
            raise ValueError(f"attention_backend 'triton' is not available on platform "
                             f"{platform!r}: the jax-triton package is not installed")
    return backend


def attention(
    q: jax.Array,             # [T, H, D]
    k_flat: jax.Array,        # [L*N*bs, KVH, D]
    v_flat: jax.Array,        # [L*N*bs, KVH, D]
    layer: jax.Array,         # [] int32
    token_rows: jax.Array,    # [T] int32, -1 = padding
    positions: jax.Array,     # [T] int32
    block_tables: jax.Array,  # [R, W] int32
    *,
    num_blocks: int,
    block_size: int,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    backend: str = "reference",
) -> jax.Array:               # [T, H, D]
    """Each token attends to its row's keys up to its own position (`sliding_window`: only
    the last that many); padding tokens come out as zeros."""
    backend = resolve_backend(backend)
    args = (q, k_flat, v_flat, layer, token_rows, positions, block_tables)
    kw = dict(num_blocks=num_blocks, block_size=block_size, scale=scale, soft_cap=soft_cap,
              sliding_window=sliding_window)
    if backend == "reference":
        return ragged_op.ragged_attention_reference(*args, **kw)
    if backend == "cpu":
        return ragged_op.ragged_attention(*args, **kw).astype(q.dtype)
    return _by_rows(*args, **kw, backend=backend)


def _by_rows(q, k_flat, v_flat, layer, token_rows, positions, block_tables, *, num_blocks,
             block_size, scale, soft_cap, sliding_window, backend):
    """The flat batch through the row-shaped Pallas / Triton kernels (see the module doc)."""
    t, h, d = q.shape
    r = block_tables.shape[0]
    kvh = k_flat.shape[1]
    cache_shape = (k_flat.shape[0] // (num_blocks * block_size), num_blocks, block_size, kvh,
                   k_flat.shape[2])   # D, or D + 4 for int8 / fp8 rows
    k_cache, v_cache = k_flat.reshape(cache_shape), v_flat.reshape(cache_shape)
    interpret = jax.default_backend() == "cpu"
    window = {"sliding_window": sliding_window, "soft_cap": soft_cap}

    def decode(_: None) -> jax.Array:   # token i is row i's only token (or padding)
        lens = jnp.where(token_rows >= 0, positions + 1, 0)
        if backend == "triton":
            if has_row_scales(k_cache.dtype):
                raise ValueError(f"attention_backend 'triton' reads float caches only, not "
                                 f"the {k_cache.dtype} KV cache; use 'pallas'")
            if sliding_window is not None:
                raise ValueError("attention_backend 'triton' has no sliding-window decode "
                                 f"(sliding_window={sliding_window}); use 'pallas'")
            from xlaserve.kernels.triton import paged_attention as triton_op

            return triton_op.paged_attention(q, k_cache, v_cache, layer, block_tables, lens,
                                             scale=scale, soft_cap=soft_cap)
        return decode_op.paged_attention(q, k_cache, v_cache, layer, block_tables, lens,
                                         scale=scale, interpret=interpret, **window)

    def prefill(_: None) -> jax.Array:  # pieces of <= PIECE tokens of one row, as rows
        member = token_rows[None, :] == jnp.arange(r, dtype=jnp.int32)[:, None]   # [R, T]
        q_lens = member.sum(axis=1).astype(jnp.int32)                            # [R]
        starts = jnp.cumsum(q_lens) - q_lens                                      # [R]
        pieces = -(-q_lens // PIECE)                                              # [R]
        first_piece = jnp.cumsum(pieces) - pieces                                 # [R]
        v = t // PIECE + r                                                        # pieces max
        piece = jnp.arange(v, dtype=jnp.int32)
        row = jnp.clip(jnp.searchsorted(first_piece + pieces, piece, side="right"), 0, r - 1)
        j = piece - first_piece[row]                                              # [V]
        first = starts[row] + j * PIECE                                           # [V]
        count = jnp.where(j < pieces[row], jnp.clip(q_lens[row] - j * PIECE, 0, PIECE), 0)
        slot = jnp.arange(PIECE, dtype=jnp.int32)
        index = jnp.clip(first[:, None] + slot[None, :], 0, t - 1)               # [V, PIECE]
        q_rows = jnp.where((slot[None, :] < count[:, None])[..., None, None], q[index], 0)
        last = jnp.clip(first + count - 1, 0, t - 1)
        kv_lens = jnp.where(count > 0, positions[last] + 1, 0).astype(jnp.int32)  # [V]
        out = prefill_op.prefill_attention(q_rows, k_cache, v_cache, layer, block_tables[row],
                                           count.astype(jnp.int32), kv_lens, scale=scale,
                                           interpret=interpret, **window)  # [V, PIECE, H, D]
        tok_row = jnp.clip(token_rows, 0, r - 1)
        offset = jnp.arange(t, dtype=jnp.int32) - starts[tok_row]                # [T]
        flat = out[jnp.clip(first_piece[tok_row] + offset // PIECE, 0, v - 1), offset % PIECE]
        return jnp.where((token_rows >= 0)[:, None, None], flat, 0).astype(q.dtype)

    if t != r:
        return prefill(None)
    one_per_row = jnp.all((token_rows == jnp.arange(t, dtype=jnp.int32)) | (token_rows < 0))
    return lax.cond(one_per_row, decode, prefill, None)
