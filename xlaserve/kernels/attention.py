"""Attention backend dispatch: the model's one call site, the backend chosen by config/platform.

    paged_attention(q [B, T, H, D], ...)   T == 1 -> decode op (paged_attention.py)
                                           T >  1 -> chunked-prefill op (prefill_attention.py)

Backends:
    reference  pure jnp, runs everywhere; defines the semantics
    pallas     the Pallas kernels; compiled through Triton on GPU, interpret=True on CPU
    triton     the jax-triton decode kernel (GPU only); prefill uses the Pallas kernel
    auto       the best available on this platform (see `resolve_backend`)
"""

from __future__ import annotations

import importlib.util

import jax

from xlaserve.kernels import paged_attention as decode_op
from xlaserve.kernels import prefill_attention as prefill_op

BACKENDS = ("reference", "pallas", "triton", "auto")


def jax_triton_available() -> bool:
    return importlib.util.find_spec("jax_triton") is not None


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """The concrete backend for `backend` on `platform` (default: jax's default backend)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    platform = platform or jax.default_backend()
    on_gpu = platform in ("gpu", "cuda", "rocm")
    if backend == "auto":
        # CPU: the reference.  Interpret mode runs the kernel grid program by program as an XLA
        # while loop and exists to test the kernels, not to serve; XLA's fused jnp is faster.
        # GPU: the Pallas kernels, which cover decode and prefill.  `triton` stays an explicit
        # choice until the H200 table (BENCHMARKS.md) shows it ahead.
        return "pallas" if on_gpu else "reference"
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


def paged_attention(
    q: jax.Array,             # [B, T, H, D]
    k_cache: jax.Array,       # [L, N, bs, KVH, D]
    v_cache: jax.Array,       # [L, N, bs, KVH, D]
    layer: jax.Array,         # [] int32
    block_tables: jax.Array,  # [B, W] int32
    q_lens: jax.Array,        # [B] int32
    kv_lens: jax.Array,       # [B] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    backend: str = "reference",
) -> jax.Array:               # [B, T, H, D]
    """Decode (T == 1) and chunked prefill (T > 1) through one entry point.

    For T == 1, a row with q_lens == 0 is padding: it comes out as zeros like in prefill.
    `sliding_window` (Mistral): each query sees only the last that many positions."""
    backend = resolve_backend(backend)
    interpret = jax.default_backend() == "cpu"
    args = (k_cache, v_cache, layer, block_tables)
    window = {"sliding_window": sliding_window}
    if q.shape[1] == 1:
        # The decode ops treat kv_len == 0 as padding; fold q_lens in so both agree.
        lens = kv_lens * (q_lens > 0).astype(kv_lens.dtype)
        if backend == "reference":
            out = decode_op.paged_attention_reference(q[:, 0], *args, lens, scale=scale,
                                                      soft_cap=soft_cap, **window)
        elif backend == "pallas":
            out = decode_op.paged_attention(q[:, 0], *args, lens, scale=scale,
                                            soft_cap=soft_cap, interpret=interpret, **window)
        else:
            if sliding_window is not None:
                raise ValueError("attention_backend 'triton' has no sliding-window decode "
                                 f"(sliding_window={sliding_window}); use 'pallas'")
            from xlaserve.kernels.triton import paged_attention as triton_op

            out = triton_op.paged_attention(q[:, 0], *args, lens, scale=scale,
                                            soft_cap=soft_cap)
        return out[:, None]
    if backend == "reference":
        return prefill_op.prefill_attention_reference(q, *args, q_lens, kv_lens, scale=scale,
                                                      soft_cap=soft_cap, **window)
    return prefill_op.prefill_attention(q, *args, q_lens, kv_lens, scale=scale,
                                        soft_cap=soft_cap, interpret=interpret, **window)
