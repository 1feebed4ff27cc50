"""The dense families as llama.cpp writes them into GGUF: architecture names, the metadata keys
that carry each family's differences (models/families.py has the HF side) and the tensor
names of their layers.

    ours     GGUF arch  its keys and tensors beyond Llama's
    qwen2    qwen2      attn_{q,k,v}.bias
    qwen3    qwen3      attn_q_norm, attn_k_norm [D]
    gemma2   gemma2     attention.sliding_window, attn_logit_softcapping,
                        final_logit_softcapping, post_attention_norm, post_ffw_norm (ffn_norm
                        is the pre-MLP norm); norms hold 1 + w
    gemma3   gemma3     gemma2's, attn_q_norm / attn_k_norm, rope.freq_base_swa (sliding
                        layers, default 10000), rope.scaling.type linear + factor (full layers)
    phi3     phi3       attn_qkv fused, ffn_up holds gate and up, rope.dimension_count
                        (partial rotary), rope_factors_long / rope_factors_short with
                        rope.scaling.attn_factor and original_context_length (LongRoPE)
    granite  granite    embedding_scale, attention.scale, residual_scale, logit_scale; q/k
                        rows permuted as llama's

Gemma's GGUF has no query_pre_attn_scalar: llama.cpp scales q by 1/sqrt(head_dim), or for the
27B checkpoints (46 layers in Gemma 2, 62 in Gemma 3) by 1/sqrt(hidden / heads), and so do we.
Sliding layers: the `attention.sliding_window_pattern` key (an int period or one bool per
layer) where present, else llama.cpp's default pattern (Gemma 2: every second layer full,
Gemma 3: every sixth).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from xlaserve.models.config import RopeScaling

# llama.cpp architecture -> ours (a `llama` file with experts is Mixtral, see gguf_file.py).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
                      "granite": "granite", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                      "olmoe": "olmoe"}
# llama.cpp permutes the q/k rows of these (its NORM rope layout); the others are NEOX-style.
PERMUTED_QK = ("llama", "granite")

_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_POST_NORMS = {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}


def layer_names(arch: str) -> dict[str, str]:
    """GGUF layer tensor kind -> its HF name inside `model.layers.{i}.`, for `arch` (ours):
    only the kinds that family uses, so that any other is reported as unused."""
    if arch == "gemma2":
        return {**_LAYER, **_POST_NORMS}
    if arch == "gemma3":
        return {**_LAYER, **_POST_NORMS, **_QK_NORMS}
    if arch == "qwen3":
        return {**_LAYER, **_QK_NORMS}
    if arch == "phi3":
        return {**_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
    return _LAYER


Field = Callable[[str, Any], Any]   # (key without the "{arch}." prefix, default) -> value


def family_fields(arch: str, field: Field, dims: dict[str, int],
                  tensor: Callable[[str], list[float] | None]) -> dict[str, Any]:
    """The ModelConfig fields of `arch`'s differences from Llama.  dims: hidden, heads,
    head_dim, layers; tensor(name): a small top-level tensor's values, or None."""
    if arch == "qwen2":
        return {"attention_bias": True}
    if arch == "qwen3":
        return {"qk_norm": True}
    if arch in ("gemma2", "gemma3"):
        return _gemma(arch, field, dims)
    if arch == "phi3":
        return _phi3(field, dims, tensor)
    if arch == "granite":
        return {"embed_scale": float(field("embedding_scale", 1.0)),
                "attention_scale": float(field("attention.scale", dims["head_dim"] ** -0.5)),
                "logits_divisor": float(field("logit_scale", 1.0))}
    return {}


def _gemma(arch: str, field: Field, dims: dict[str, int]) -> dict[str, Any]:
    big = dims["layers"] == (46 if arch == "gemma2" else 62)   # llama.cpp's 27B rule
    scalar = dims["hidden"] // dims["heads"] if big else dims["head_dim"]
    window = field("attention.sliding_window", 4096 if arch == "gemma2" else None)
    out: dict[str, Any] = dict(
        embed_scale=float(dims["hidden"]) ** 0.5, post_norms=True, mlp_activation="gelu_tanh",
        attention_scale=float(scalar) ** -0.5,
        attn_soft_cap=_positive(field("attn_logit_softcapping", None)),
        final_soft_cap=_positive(field("final_logit_softcapping", None)))
    if window:
        out.update(sliding_window=int(window),
                   layer_kinds=_layer_kinds(field("attention.sliding_window_pattern", None),
                                            2 if arch == "gemma2" else 6, dims["layers"]))
    if arch == "gemma3":
        out["qk_norm"] = True
        if window:
            out["rope_local_theta"] = float(field("rope.freq_base_swa", 10000.0))
    return out


def _layer_kinds(pattern: Any, default: int, layers: int) -> tuple[str, ...]:
    if isinstance(pattern, (list, tuple)):   # one bool per layer: sliding?
        if len(pattern) != layers:
            raise ValueError(f"attention.sliding_window_pattern has {len(pattern)} entries for "
                             f"{layers} layers")
        return tuple("sliding" if p else "full" for p in pattern)
    period = int(pattern or default)
    return tuple("full" if (i + 1) % period == 0 else "sliding" for i in range(layers))


def _phi3(field: Field, dims: dict[str, int],
          tensor: Callable[[str], list[float] | None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rotary = int(field("rope.dimension_count", dims["head_dim"]))
    if rotary != dims["head_dim"]:
        out["rotary_dim"] = rotary
    window = field("attention.sliding_window", 0)
    if window:
        out["sliding_window"] = int(window)
    long, short = tensor("rope_factors_long.weight"), tensor("rope_factors_short.weight")
    if long is not None and short is not None:
        original = int(field("rope.scaling.original_context_length", 0))
        if original <= 0:
            raise ValueError("phi3 rope factors without rope.scaling.original_context_length")
        factor = int(field("context_length", original)) / original
        default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        out["rope_scaling"] = RopeScaling(
            kind="longrope", factor=factor, original_max_position_embeddings=original,
            short_factor=tuple(short), long_factor=tuple(long),
            attention_factor=float(field("rope.scaling.attn_factor", default)))
    return out


def _positive(value: Any) -> float | None:
    return None if not value else float(value)
