"""Tiny random dense models of each family made with transformers (Qwen2, Qwen3, Gemma 2,
Gemma 3, Phi-3 with LongRoPE and partial rotary, Granite), saved as HF safetensors with a
byte-level tokenizer and converted: shared by the family tests.  Shapes vary on purpose: GQA
ratios, head_dim 16 to 256, tied and untied heads, windows shorter than the test prompts."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.moe_models import save_with_tokenizer

_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
             "long_factor": [1.5 + 0.5 * i for i in range(6)],
             "original_max_position_embeddings": 64}

FAMILY_VARIANTS = {
    "qwen2-gqa": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, tie_word_embeddings=False),
    "qwen2-tied-d64": dict(model_type="qwen2", num_attention_heads=2, num_key_value_heads=2,
                           head_dim=64, tie_word_embeddings=True),
    "qwen3-d128": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=1,
                       head_dim=128, tie_word_embeddings=False),
    "qwen3-tied-d64": dict(model_type="qwen3", num_attention_heads=8, num_key_value_heads=2,
                           head_dim=64, tie_word_embeddings=True),
    "gemma2-d128": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=1,
                        head_dim=128, sliding_window=40, tie_word_embeddings=True),
    # transformers' own layer pattern (every sixth layer full): all four sliding here
    "gemma3-d256-all-sliding": dict(model_type="gemma3_text", num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=256, sliding_window=32,
                                    tie_word_embeddings=True),
    "phi3-d64-mqa": dict(model_type="phi3", num_attention_heads=1, num_key_value_heads=1,
                         tie_word_embeddings=True),
    "granite-untied-d32": dict(model_type="granite", num_attention_heads=2,
                               num_key_value_heads=1, embedding_multiplier=12.0,
                               attention_multiplier=0.03, residual_multiplier=0.22,
                               logits_scaling=2.0, tie_word_embeddings=False),
    "gemma2-d256": dict(model_type="gemma2", num_attention_heads=2, num_key_value_heads=1,
                        head_dim=256, query_pre_attn_scalar=48, sliding_window=24,
                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                        tie_word_embeddings=True),
    "gemma3-d64": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, query_pre_attn_scalar=64, sliding_window=24,
                       layer_types=["sliding_attention", "full_attention",
                                    "sliding_attention", "sliding_attention"],
                       rope_parameters={"sliding_attention": {"rope_type": "default",
                                                              "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1000000.0}},
                       tie_word_embeddings=True),
    "phi3-window": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=32, tie_word_embeddings=False),
    "phi3-longrope-partial": dict(model_type="phi3", num_attention_heads=4,
                                  num_key_value_heads=4, partial_rotary_factor=0.75,
                                  max_position_embeddings=256,
                                  original_max_position_embeddings=64,
                                  rope_parameters={**_LONGROPE, "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.75},
                                  tie_word_embeddings=False),
    "granite": dict(model_type="granite", num_attention_heads=4, num_key_value_heads=2,
                    embedding_multiplier=6.0, attention_multiplier=0.2,
                    residual_multiplier=0.3, logits_scaling=4.0, tie_word_embeddings=True),
}


def hf_family_model(variant: dict, layers: int = 4):
    """A tiny random transformers model, its norms and biases made non-trivial."""
    from transformers import AutoConfig, AutoModelForCausalLM

    variant = dict(variant)
    kind = variant.pop("model_type")
    variant.setdefault("max_position_embeddings", 512)
    cfg = AutoConfig.for_model(kind, vocab_size=256, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=layers, rms_norm_eps=1e-6, bos_token_id=1,
                               eos_token_id=2, pad_token_id=0, **variant)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif kind.startswith("gemma") or kind == "granite":
                p.mul_(3.0)   # logits large enough for the soft caps and multipliers to bite
    return model


def convert_family(name: str, folder: Path, layers: int = 4) -> tuple[Path, object]:
    """`name`'s HF model saved under folder/hf and converted to folder/ours; (ours, hf)."""
    from xlaserve.checkpoints.convert import convert_hf

    hf = hf_family_model(FAMILY_VARIANTS[name], layers)
    save_with_tokenizer(hf, folder / "hf")
    convert_hf(folder / "hf", folder / "ours", quiet=True)
    return folder / "ours", hf
