"""A sentencepiece Llama: a tokenizer trained here, a small random Llama saved by transformers as
safetensors, converted with `xlaserve convert hf` -- and, written out as a llama.cpp-style GGUF
(sentencepiece vocabulary, permuted q/k rows), with `xlaserve convert gguf` -- then logits and
token ids compared with transformers and sentencepiece."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import finish_gguf, full_logits, max_rel_error
from xlaserve.checkpoints.convert import convert_gguf, convert_hf
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
        eos_id=2, pad_id=-1, minloglevel=2,
        # Llama's own tokenizer.model: no Unicode normalization, whitespace kept as written
        normalization_rule_name="identity", remove_extra_whitespaces=False)
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


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py `permute`): each head's two rotary halves
    interleaved row by row."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf_dir: Path, path: Path, extra: dict[str, np.ndarray] | None = None) -> None:
    """The tiny HF Llama and its sentencepiece vocabulary as a GGUF file, laid out the way
    llama.cpp's converter writes one (F32 tensors), plus the tensors in `extra`."""
    import gguf
    import sentencepiece as spm
    from safetensors.numpy import load_file

    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL
             if sp.is_control(i) else gguf.TokenType.BYTE if sp.is_byte(i)
             else gguf.TokenType.NORMAL for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in sorted(load_file(hf_dir / "model.safetensors").items()):
        t = np.ascontiguousarray(t, dtype=np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            kind, suffix = rest.rsplit(".", 1)
            if kind == "self_attn.q_proj":
                t = _permute(t, 4)
            elif kind == "self_attn.k_proj":
                t = _permute(t, 2)
            names[name] = f"blk.{i}.{layer[kind]}.{suffix}"
        w.add_tensor(names[name], t)
    finish_gguf(w, extra)


def test_gguf_with_sentencepiece_vocabulary(spm_llama, tmp_path: Path) -> None:
    """`convert gguf` of a sentencepiece-vocabulary GGUF: the rebuilt tokenizer gives
    sentencepiece's ids (and transformers' own GGUF reading agrees), and the logits match the
    HF model the GGUF was written from."""
    import sentencepiece as spm
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf_dir, _ = spm_llama
    path = tmp_path / "spm-llama.gguf"
    _write_gguf(hf_dir, path)
    out = tmp_path / "ours"
    convert_gguf(path, out, quiet=True)
    assert (out / "tokenizer.model").exists() and not (out / "tokenizer.json").exists()
    model = load_model(out)
    tok = model.tokenizer
    assert tok.kind == "sentencepiece" and tok.add_bos and tok.bos_id == 1
    assert tok.eos_ids == (2,)

    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = SAMPLES + ["naïve café: ünïcödé falls back to bytes 🎉", "two  spaces\n\tx  "]
    for text in texts + ["  leading spaces"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        # transformers' GGUF reader skips the dummy prefix before a leading space, unlike
        # sentencepiece and llama.cpp; it agrees everywhere else
        if text in texts:
            assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.add(i) for i in ids) + detok.flush() == text

    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = tok.encode(" ".join(SAMPLES))
    assert ids[0] == 1
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert max_rel_error(full_logits(model.params, model.config, ids), ref) < 1e-5


def _llama3_freq_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                         high_freq_factor: float, original_max_position_embeddings: int
                         ) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): Llama 3 scaling as
    one divisor per rotary frequency, written as `rope_freqs.weight`."""
    old = original_max_position_embeddings
    low_wavelen, high_wavelen = old / low_freq_factor, old / high_freq_factor
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_gguf_llama3_rope_freqs(spm_llama, tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1/3.2 RoPE scaling only as the `rope_freqs.weight` tensor: a GGUF
    carrying it converts to logits matching transformers with the same `rope_type: llama3`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir, _ = spm_llama
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    factors = _llama3_freq_factors(16, 10000.0, **scaling)
    assert (factors == 1.0).any() and (factors == 8.0).any()  # all three regimes are exercised
    path = tmp_path / "llama3.gguf"
    _write_gguf(hf_dir, path, {"rope_freqs.weight": factors})
    out = tmp_path / "ours"
    convert_gguf(path, out, quiet=True)
    model = load_model(out)

    cfg = LlamaConfig.from_pretrained(hf_dir)
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, **scaling}
    hf = LlamaForCausalLM.from_pretrained(hf_dir, config=cfg, dtype=torch.float32).eval()
    plain = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = model.tokenizer.encode(" ".join(SAMPLES))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
        unscaled = plain(torch.tensor([ids])).logits[0].numpy()
    ours = full_logits(model.params, model.config, ids)
    assert max_rel_error(ours, ref) < 1e-5
    assert max_rel_error(unscaled, ref) > 1e-3  # the scaling is visible in these logits
    assert model.config.rope_freq_factors == tuple(float(f) for f in factors)


def test_gguf_sentencepiece_vocabulary_errors(tmp_path: Path) -> None:
    from xlaserve.checkpoints.gguf_tokenizer import tokenizer_from_gguf

    base = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b", "a"],
            "tokenizer.ggml.scores": [0.0, -1.0, -2.0], "tokenizer.ggml.token_type": [2, 1, 1]}
    with pytest.raises(ValueError, match=r"repeats the piece 'a' \(id 2\)"):
        tokenizer_from_gguf(base, tmp_path)
    no_unk = {**base, "tokenizer.ggml.tokens": ["a", "b", "c"],
              "tokenizer.ggml.token_type": [1, 1, 1]}
    with pytest.raises(ValueError, match="needs an unknown token"):
        tokenizer_from_gguf(no_unk, tmp_path)
    with pytest.raises(ValueError, match="scores has 2 entries for 3 tokens"):
        tokenizer_from_gguf({**no_unk, "tokenizer.ggml.scores": [0.0, 1.0]}, tmp_path)
    with pytest.raises(ValueError, match=r"GGUF tokenizer model 'bert' is not supported"):
        tokenizer_from_gguf({**base, "tokenizer.ggml.model": "bert"}, tmp_path)
