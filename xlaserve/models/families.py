"""The model families, each as its differences from the Llama block, read from a Hugging Face
`config.json` into ModelConfig fields (models/config.py names and checks them; models/llama.py
runs them; checkpoints/family_tensors.py adapts each family's tensors to the Llama names).

    family     differences from Llama
    qwen2      q/k/v biases
    qwen3      per-head RMSNorm of q and k before RoPE; explicit head_dim
    gemma2     (1 + w) norms (folded at conversion), post-norms on the attention and MLP outputs,
               embeddings * sqrt(E), GeGLU (tanh GELU), query_pre_attn_scalar ** -0.5 as the
               attention scale, attention and final logit soft caps, sliding / full layers
    gemma3     Gemma 2's, with q/k norms, no soft caps, its own layer pattern and a RoPE per
               kind of layer (sliding: rope_local_base_freq, full: rope_theta with its scaling)
    phi3       fused qkv and gate_up (split at conversion), sliding window, LongRoPE, partial
               rotary
    granite    embedding, attention, residual (folded into wo / w_down) and logits multipliers
    mistral    sliding window
    mixtral, qwen2_moe, qwen3_moe, olmoe: routed experts (models/moe.py)
"""

from __future__ import annotations

import math
from typing import Any

from xlaserve.models.config import (
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
)

# HF model_type -> our architecture name, where they differ.
_ALIASES = {"gemma3_text": "gemma3"}


def config_from_hf(hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
    """ModelConfig of a HF `config.json` (a `gemma3` checkpoint: its text tower)."""
    if hf.get("model_type") == "gemma3" and isinstance(hf.get("text_config"), dict):
        hf = {**hf["text_config"], "model_type": "gemma3_text",
              "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    model_type = hf.get("model_type", "")
    arch = _ALIASES.get(model_type, model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r} in config.json; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id", 2)
    max_pos = hf.get("max_position_embeddings", 4096)
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(_rope_theta(hf, "full_attention") or 10000.0),
        rope_scaling=rope_scaling_from_hf(_rope_table(hf, "full_attention"), hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=(tuple(eos) if isinstance(eos, list) else ()
                       if eos is None else (eos,)),
        architecture=arch,
        dtype=dtype,
    )
    _check_no_bias(hf, arch)
    fields.update(_FAMILIES.get(arch, _moe_from_hf)(hf))
    window = fields.get("sliding_window")
    if window is not None and window >= max_pos and fields.get("layer_kinds") is None:
        # a window no shorter than the context never hides a position: plain causal attention
        fields["sliding_window"] = None
    return ModelConfig(**fields)


# -- the families' differences ---------------------------------------------------------------


def _mistral(hf: dict[str, Any]) -> dict[str, Any]:
    window = hf.get("sliding_window")
    return {"sliding_window": None if window is None else int(window)}


def _qwen2(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("use_sliding_window"):
        raise ValueError(f"{hf['model_type']}: use_sliding_window=true (a window on the layers "
                         f"from max_window_layers on) is not supported")
    if hf["model_type"] == "qwen2":   # transformers gives Qwen2 q/k/v biases always
        return {"attention_bias": True}
    return {"attention_bias": bool(hf.get("attention_bias", False)), "qk_norm": True}


def _gemma(hf: dict[str, Any]) -> dict[str, Any]:
    kind = hf["model_type"]
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{kind}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{kind}: use_bidirectional_attention=true is not supported")
    out: dict[str, Any] = dict(
        embed_scale=float(hf["hidden_size"]) ** 0.5, post_norms=True, mlp_activation="gelu_tanh",
        attention_scale=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim")) ** -0.5,
        attn_soft_cap=_positive_or_none(hf.get("attn_logit_softcapping")),
        final_soft_cap=_positive_or_none(hf.get("final_logit_softcapping")),
        sliding_window=int(hf["sliding_window"]),
        layer_kinds=_layer_kinds(hf, 2 if kind == "gemma2" else 6))
    if kind != "gemma2":
        out.update(qk_norm=True,
                   rope_local_theta=float(_rope_theta(hf, "sliding_attention")
                                          or hf.get("rope_local_base_freq") or 10000.0))
        local = _rope_table(hf, "sliding_attention")
        if local is not None and rope_scaling_from_hf(local, hf) is not None:
            raise ValueError(f"{kind}: rope scaling on the sliding layers is not supported")
    return out


def _phi3(hf: dict[str, Any]) -> dict[str, Any]:
    table = _rope_table(hf, "full_attention") or {}
    partial = float(hf.get("partial_rotary_factor") or table.get("partial_rotary_factor") or 1.0)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rotary = int(head_dim * partial)
    window = hf.get("sliding_window")
    return {"rotary_dim": None if rotary == head_dim else rotary,
            "sliding_window": None if window is None else int(window)}


def _granite(hf: dict[str, Any]) -> dict[str, Any]:
    # residual_multiplier is folded into wo and w_down (checkpoints/family_tensors.py)
    return {"embed_scale": float(hf.get("embedding_multiplier", 1.0)),
            "attention_scale": float(hf.get("attention_multiplier", 1.0)),
            "logits_divisor": float(hf.get("logits_scaling", 1.0))}


_FAMILIES = {"llama": lambda hf: {}, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen2,
             "gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3, "granite": _granite}


def _check_no_bias(hf: dict[str, Any], arch: str) -> None:
    """Biases the shared block has no place for: refused by name, never dropped."""
    if arch in ("llama", "mistral", "granite", "gemma2", "gemma3") and hf.get("attention_bias"):
        raise ValueError(f"{hf['model_type']}: attention_bias=true (biases on q/k/v/o) is not "
                         f"supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{hf['model_type']}: mlp_bias=true is not supported")


def _positive_or_none(value: Any) -> float | None:
    return None if value is None or value == 0 else float(value)


def _layer_kinds(hf: dict[str, Any], period: int) -> tuple[str, ...]:
    """Each layer "sliding" or "full": from `layer_types` (transformers 5.x), else the family's
    pattern (Gemma 2: even layers sliding; Gemma 3: every `sliding_window_pattern`-th full)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is not None:
        names = {"sliding_attention": "sliding", "full_attention": "full"}
        bad = [t for t in types if t not in names]
        if len(types) != n or bad:
            raise ValueError(f"{hf['model_type']}: layer_types must give sliding_attention or "
                             f"full_attention for each of {n} layers, got {types!r}")
        return tuple(names[t] for t in types)
    period = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or period)
    return tuple("full" if (i + 1) % period == 0 else "sliding" for i in range(n))


def _rope_table(hf: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The RoPE parameters of `kind` layers: transformers 5.x `rope_parameters` (flat, or keyed
    by full_attention / sliding_attention), else 4.x `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        return params[kind]
    if isinstance(params, dict) and kind == "full_attention" and not any(
            isinstance(v, dict) for v in params.values()):
        return params
    return hf.get("rope_scaling") if kind == "full_attention" else None


def _rope_theta(hf: dict[str, Any], kind: str) -> float | None:
    table = _rope_table(hf, kind)
    if isinstance(table, dict) and table.get("rope_theta") is not None:
        return float(table["rope_theta"])
    return hf.get("rope_theta") if kind == "full_attention" else None


def rope_scaling_from_hf(rs: dict[str, Any] | None, hf: dict[str, Any]) -> RopeScaling | None:
    """A HF rope table (`rope_type` / `type` and its parameters) as RopeScaling."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    if kind in ("longrope", "su"):
        return _longrope(rs, hf)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, llama3, "
                     f"linear, longrope)")


def _longrope(rs: dict[str, Any], hf: dict[str, Any]) -> RopeScaling:
    """Phi-3's LongRoPE: s = max_position_embeddings / original_max_position_embeddings, cos
    and sin scaled by sqrt(1 + ln s / ln original) unless the table gives attention_factor."""
    original = int(rs.get("original_max_position_embeddings")
                   or hf.get("original_max_position_embeddings") or 0)
    if original <= 0:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    factor = rs.get("factor") or hf.get("max_position_embeddings", original) / original
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(kind="longrope", factor=float(factor),
                       original_max_position_embeddings=original,
                       short_factor=tuple(float(f) for f in rs["short_factor"]),
                       long_factor=tuple(float(f) for f in rs["long_factor"]),
                       attention_factor=float(attention))


def _moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a HF config.json (none for a dense model)."""
    kind = hf["model_type"]
    if kind not in MOE_ARCHITECTURES:
        return {}
    if kind == "mixtral":
        return dict(num_experts=hf["num_local_experts"],
                    num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                    **_mistral(hf))
    if kind == "olmoe":
        if hf.get("clip_qkv") is not None:
            raise ValueError(f"olmoe: clip_qkv={hf['clip_qkv']} is not supported")
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        if hf.get("head_dim") not in (None, hidden // heads):
            raise ValueError(f"olmoe: head_dim={hf['head_dim']} must be hidden_size / "
                             f"num_attention_heads = {hidden // heads} (its q norm spans "
                             f"hidden_size)")
        return dict(num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
                    qk_norm_span="all")
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ValueError(f"{kind}: decoder_sparse_step={step}, mlp_only_layers={dense}: "
                         f"models with dense layers among the MoE layers are not supported")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{kind}: use_sliding_window=true is not supported")
    out = dict(num_experts=hf.get("num_experts") or hf["num_local_experts"],
               num_experts_per_tok=hf["num_experts_per_tok"],
               moe_intermediate_size=hf["moe_intermediate_size"],
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
                   attention_bias=bool(hf.get("qkv_bias", True)))
    else:
        out.update(attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
    return out
