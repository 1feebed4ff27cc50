"""A sentencepiece Llama: a tokenizer trained here, a small random Llama saved by transformers as
safetensors, converted with `xlaserve convert hf`, then logits and token ids compared."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import full_logits, max_rel_error
from xlaserve.checkpoints.convert import convert_hf
from xlaserve.serving.loading import load_model
from xlaserve.serving.tokenizer import IncrementalDetokenizer

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = [
    "The scheduler decides every step which requests run.",
    "Paged attention reads keys and values through a block table.",
    "Tokens stream back to the client, one event at a time.",
]


@pytest.fixture(scope="module")
def spm_llama(tmp_path_factory) -> tuple[Path, Path]:
    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

    work = tmp_path_factory.mktemp("spm")
    corpus = work / "corpus.txt"
    text = "\n".join(p.read_text() for p in sorted((ROOT / "xlaserve").rglob("*.py")))
    corpus.write_text(text[:60_000] + "\n" + "\n".join(SAMPLES))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(work / "tokenizer"), vocab_size=512,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, minloglevel=2)
    sp_dir = work / "sp"
    sp_dir.mkdir()
    shutil.copy(work / "tokenizer.model", sp_dir / "tokenizer.model")

    hf_dir = work / "hf"
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(hf_dir)
    LlamaTokenizer.from_pretrained(sp_dir).save_pretrained(hf_dir)
    shutil.copy(work / "tokenizer.model", hf_dir / "tokenizer.model")
    out = work / "ours"
    convert_hf(hf_dir, out, quiet=True)
    return hf_dir, out


def test_logits_match(spm_llama) -> None:
    from transformers import LlamaForCausalLM

    hf_dir, ours_dir = spm_llama
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = load_model(ours_dir)
    assert model.tokenizer.kind == "sentencepiece"
    ids = model.tokenizer.encode(" ".join(SAMPLES))
    assert ids[0] == 1  # BOS
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert max_rel_error(full_logits(model.params, model.config, ids), ref) < 1e-5


def test_tokenizer_matches_reference(spm_llama) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    hf_dir, ours_dir = spm_llama
    tok = load_model(ours_dir).tokenizer
    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    for text in SAMPLES + ["naïve café: ünïcödé falls back to bytes 🎉"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text) == hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.add(i) for i in ids) + detok.flush() == text
