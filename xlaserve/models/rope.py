"""Rotary position embeddings (the HF "rotate half" layout), with optional Llama 3 scaling,
given as its parameters (HF) or as per-dimension frequency divisors (llama.cpp's rope_freqs)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32, computed on the host once per model."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = config.rope_scaling
    if rs is not None:
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(medium, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    if config.rope_freq_factors is not None:
        # llama.cpp (ggml_rope_ext freq_factors): theta / factor for each dimension pair
        inv = inv / np.asarray(config.rope_freq_factors, dtype=np.float64)
    return inv.astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [...] (e.g. [T]), inv_freq [D // 2] -> (cos, sin), each [..., D // 2] float32:
    the rotation of every token, the same for every head and layer (applied by
    kernels/rope_kv_write.rotate)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq       # [..., D/2]
    return jnp.cos(angles), jnp.sin(angles)

