"""A tiny random Llama with SmolLM2's tokenizer, in both worlds: saved by transformers as
safetensors (for the hf system) and converted with `xlaserve convert hf` (for engine and
static), so all three systems run the same weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.serving.live_server import make_server, tokenizer  # noqa: F401 (fixtures)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, model_dir: Path) -> tuple[Path, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from xlaserve.checkpoints.convert import convert_hf

    work = tmp_path_factory.mktemp("tiny_llama")
    hf_dir = work / "hf"
    # A wide init range makes greedy choices clear-cut (no near ties between systems).
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(hf_dir)
    shutil.copy(model_dir / "tokenizer.json", hf_dir / "tokenizer.json")
    out = work / "ours"
    convert_hf(hf_dir, out, quiet=True)
    return hf_dir, out
