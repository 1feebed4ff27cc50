"""Rotary position embeddings (the HF "rotate half" layout) and their scalings: Llama 3's,
linear (Gemma 3's full layers), LongRoPE (Phi-3/4), llama.cpp's per-dimension `rope_freqs`,
partial rotary and a RoPE base of its own for sliding layers (Gemma 3).

Partial rotary (`rotary_dim` R < D): HF rotates each head's first R features as pairs
(j, j + R/2) and passes the rest through.  The converter moves the q/k features so that those
pairs sit at (j, j + D/2) (checkpoints/family_tensors.py: a permutation applied to q and k alike
leaves q.k unchanged), and the pairs j >= R/2 get frequency 0 here: cos 1, sin 0, passed
through.  LongRoPE picks its long factors for the whole model when it runs beyond
`original_max_position_embeddings` (ModelConfig.max_position_embeddings, which the engine caps
at its max_model_len: ModelConfig.for_context), its short factors otherwise, as llama.cpp
does by its context size: each request gets one RoPE for all of its tokens, where
transformers recomputes a sequence with the long factors once it crosses that length."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig, kind: str = "full") -> np.ndarray:
    """[head_dim // 2] float32 for `kind` layers ("full" or "sliding"), on the host once."""
    d, r = config.head_dim, config.rotary_dim or config.head_dim
    local = kind == "sliding" and config.rope_local_theta is not None
    theta = config.rope_local_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, r, 2, dtype=np.float64) / r))            # [R/2]
    rs = None if local else config.rope_scaling
    if rs is not None and rs.kind == "llama3":
        inv = _llama3(inv, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                      rs.original_max_position_embeddings)
    elif rs is not None and rs.kind == "linear":
        inv = inv / rs.factor
    elif rs is not None and rs.kind == "longrope":
        inv = inv / np.asarray(rs.long_factor if _long(config) else rs.short_factor, np.float64)
    if config.rope_freq_factors is not None and not local:
        # llama.cpp (ggml_rope_ext freq_factors): theta / factor for each dimension pair
        inv = inv / np.asarray(config.rope_freq_factors, dtype=np.float64)
    return np.pad(inv, (0, (d - r) // 2)).astype(np.float32)                     # [D/2]


def _long(config: ModelConfig) -> bool:
    rs = config.rope_scaling
    return rs is not None and config.max_position_embeddings > rs.original_max_position_embeddings


def _llama3(inv: np.ndarray, factor: float, low: float, high: float,
            original: int) -> np.ndarray:
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)


def rope_amplitude(config: ModelConfig, kind: str = "full") -> float:
    """LongRoPE's factor on cos and sin (1 elsewhere)."""
    rs = config.rope_scaling
    if rs is None or rs.kind != "longrope" or (kind == "sliding" and config.rope_local_theta):
        return 1.0
    return rs.attention_factor


def rope_tables(positions: jax.Array, inv_freq: jax.Array,
                amplitude: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """positions [...] (e.g. [T]), inv_freq [D // 2] -> (cos, sin), each [..., D // 2] float32:
    the rotation of every token, the same for every head and layer (applied by
    kernels/rope_kv_write.rotate); `amplitude` scales the rotated pairs (frequency > 0)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq       # [..., D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if amplitude != 1.0:
        cos = jnp.where(inv_freq > 0, cos * amplitude, cos)
        sin = sin * amplitude
    return cos, sin


def model_rope_tables(config: ModelConfig, positions: jax.Array
                      ) -> dict[str, tuple[jax.Array, jax.Array]]:
    """(cos, sin) [T, D/2] for each kind of layer the model has ("full", and "sliding" where
    its sliding layers have a RoPE of their own)."""
    kinds = ["full"] + (["sliding"] if config.rope_local_theta is not None else [])
    return {k: rope_tables(positions, jnp.asarray(inverse_frequencies(config, k)),
                           rope_amplitude(config, k)) for k in kinds}
