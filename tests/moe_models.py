"""Tiny random mixture-of-experts models made with transformers, shared by the MoE tests:
Mixtral, Qwen2-MoE (shared expert, q/k/v biases; with and without norm_topk_prob), Qwen3-MoE
(per-head q/k norms) and OLMoE (q/k norms over all heads at once), saved as HF safetensors
with a byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

MOE_VARIANTS = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=96),
    "qwen2-moe-shared": dict(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=48, shared_expert_intermediate_size=80,
                             norm_topk_prob=False),
    "qwen2-moe-norm-topk": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=3,
                                moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                norm_topk_prob=True),
    "qwen3-moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    "olmoe": dict(model_type="olmoe", num_experts=8, num_experts_per_tok=2,
                  intermediate_size=32, norm_topk_prob=False),
}


def hf_moe_model(variant: dict, layers: int = 2):
    """A tiny random transformers MoE model, its norms (and Qwen2's biases) made non-trivial."""
    from transformers import AutoConfig, AutoModelForCausalLM

    variant = dict(variant)
    kind = variant.pop("model_type")
    variant.setdefault("intermediate_size", 160)   # OLMoE: its experts' size
    cfg = AutoConfig.for_model(kind, vocab_size=256, hidden_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=512, rms_norm_eps=1e-6,
                               tie_word_embeddings=False, **variant)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):  # routers: gates far from uniform
                p.mul_(20.0)
    return model


def save_with_tokenizer(model, folder: Path) -> None:
    """save_pretrained plus a byte-level tokenizer, so the conversion is complete."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    model.save_pretrained(folder)
    tok = Tokenizer(models.BPE(vocab={chr(0x100 + i): i for i in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def convert_moe(name: str, folder: Path, layers: int = 2) -> tuple[Path, object]:
    """`name`'s HF model saved under folder/hf and converted to folder/ours; (ours, hf model)."""
    from xlaserve.checkpoints.convert import convert_hf

    hf = hf_moe_model(MOE_VARIANTS[name], layers)
    save_with_tokenizer(hf, folder / "hf")
    convert_hf(folder / "hf", folder / "ours", quiet=True)
    return folder / "ours", hf
