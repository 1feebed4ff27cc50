"""The JAX model against Hugging Face transformers on tiny random Llama-family models:
GQA, tied and separate output embeddings, llama3 RoPE scaling, Mistral (with and without a
sliding window), chunked prefill, token-by-token decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import full_logits, max_rel_error
from xlaserve.checkpoints.convert import convert_hf
from xlaserve.serving.loading import load_model

VARIANTS = {
    "llama-gqa-tied": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True),
    "llama3-rope-scaling": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=1,
                                tie_word_embeddings=False, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}),
    "mistral-mha": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=4,
                        tie_word_embeddings=False),
    # Mistral 7B v0.1's sliding window, shrunk: 150 tokens see past a 24-token window.
    "mistral-sliding-window": dict(model_type="mistral", num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False,
                                   sliding_window=24),
}


def _hf_model(variant: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    kind = variant.pop("model_type")
    cfg = AutoConfig.for_model(kind, vocab_size=256, hidden_size=64, intermediate_size=160,
                               num_hidden_layers=3, head_dim=16, max_position_embeddings=512,
                               rms_norm_eps=1e-6, **variant)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # make the norms non-trivial so that a wrong norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_transformers(name: str, tmp_path) -> None:
    hf = _hf_model(dict(VARIANTS[name]))
    hf.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "ours", quiet=True) if _has_tokenizer(tmp_path) else \
        _convert_without_tokenizer(tmp_path)
    model = load_model(tmp_path / "ours")
    ids = np.random.default_rng(1).integers(0, 256, size=150).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = full_logits(model.params, model.config, ids)
    assert max_rel_error(ours, ref) < 1e-5
    # The same sequence prefilled in chunks of 37 through the paged cache.
    chunked = full_logits(model.params, model.config, ids, chunk=37)
    assert max_rel_error(chunked, ref) < 1e-5
    if VARIANTS[name].get("sliding_window"):
        assert model.config.sliding_window == 24
        # Token by token: the decode path, its window ending at the newest token.
        decoded = full_logits(model.params, model.config, ids, chunk=1)
        assert max_rel_error(decoded, ref) < 1e-5
        # Without the window the logits past it differ: the window is really applied.
        full = full_logits(model.params, model.config.replace(sliding_window=None), ids)
        assert max_rel_error(full[24:], ref[24:]) > 1e-2
        assert max_rel_error(full[:24], ref[:24]) < 1e-5


def _has_tokenizer(path) -> bool:
    return (path / "hf" / "tokenizer.json").exists()


def _convert_without_tokenizer(tmp_path) -> None:
    """These models have no tokenizer; give them a byte-level one so conversion is complete."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={chr(0x100 + i): i for i in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    convert_hf(tmp_path / "hf", tmp_path / "ours", quiet=True)
