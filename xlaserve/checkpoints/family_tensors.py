"""Each family's tensors under the Llama names and layouts that checkpoints/layout.py reads:

    phi3       self_attn.qkv_proj [(H + 2K) * D, E] -> q_proj, k_proj, v_proj rows;
               mlp.gate_up_proj [2F, E] -> gate_proj (first F rows), up_proj
    gemma2/3   every norm weight w -> 1 + w (HF stores w; a GGUF stores 1 + w already)
    granite    o_proj and down_proj times residual_multiplier (x + m * f(x) = x + (m W) ...)
    partial rotary (rotary_dim R < D): each head's q/k features reordered so that HF's rotary
               pairs (j, j + R/2), j < R/2, sit at (j, j + D/2) and the R..D pass-through
               features fill the rest of each half (models/rope.py gives those frequency 0)

The same permutation on q and k leaves every q.k, and so the model, unchanged.  Sources read
as int8 (GGUF Q8_0, `get_int8`) keep that path only for families whose matrices pass through
as they are; the others are read as float and quantized afterwards.
"""

from __future__ import annotations

import numpy as np

from xlaserve.checkpoints.layout import GetInt8, GetTensor
from xlaserve.models.config import ModelConfig

_LAYER = "model.layers."


def rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """[D] the HF feature of each of our features within a head (see the module docstring)."""
    half, r2 = head_dim // 2, rotary_dim // 2
    rest = np.arange(rotary_dim, head_dim)                 # pass-through features
    first, second = rest[: len(rest) // 2], rest[len(rest) // 2:]
    order = np.concatenate([np.arange(r2), first, np.arange(r2, rotary_dim), second])
    assert len(order) == head_dim and len(first) == half - r2, (head_dim, rotary_dim)
    return order


def adapted(config: ModelConfig, get: GetTensor, *, residual_multiplier: float = 1.0,
            norms_hold_one: bool = False) -> GetTensor:
    """`get` (the source's tensors by HF name) as the Llama names and layouts of this family."""
    c = config
    fused = c.architecture == "phi3"
    gemma = c.architecture in ("gemma2", "gemma3")
    order = rotary_order(c.head_dim, c.rotary_dim) if c.rotary_dim else None

    def read(name: str) -> np.ndarray:
        if fused and name.startswith(_LAYER):
            w = _split_fused(c, get, name)
            if w is not None:
                return w
        return np.asarray(get(name), np.float32)

    def adapted_get(name: str) -> np.ndarray:
        w = read(name)
        if gemma and not norms_hold_one and name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        if residual_multiplier != 1.0 and name.endswith(("o_proj.weight", "down_proj.weight")):
            w = w * np.float32(residual_multiplier)
        if order is not None and name.endswith(("q_proj.weight", "k_proj.weight",
                                                "q_proj.bias", "k_proj.bias")):
            w = w.reshape(-1, c.head_dim, *w.shape[1:])[:, order].reshape(w.shape)
        return w

    return adapted_get


def _split_fused(c: ModelConfig, get: GetTensor, name: str) -> np.ndarray | None:
    """Phi-3's q/k/v or gate/up rows out of its fused tensors; None for any other name."""
    prefix, _, leaf = name.rpartition(".")         # model.layers.{i}.self_attn.q_proj, weight
    prefix, _, proj = prefix.rpartition(".")
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    if proj in rows:
        w = np.asarray(get(f"{prefix}.qkv_proj.{leaf}"), np.float32)
        start, stop = rows[proj]
        return w[start:stop]
    f = c.intermediate_size
    if proj in ("gate_proj", "up_proj"):
        w = np.asarray(get(f"{prefix}.gate_up_proj.{leaf}"), np.float32)
        return w[:f] if proj == "gate_proj" else w[f:]
    return None


def adapted_int8(config: ModelConfig, get_int8: GetInt8 | None,
                 residual_multiplier: float = 1.0) -> GetInt8 | None:
    """The int8 reader where the family's matrices pass through unchanged, else None."""
    changes = (config.architecture == "phi3" or config.rotary_dim is not None
               or residual_multiplier != 1.0)
    return None if changes else get_int8
