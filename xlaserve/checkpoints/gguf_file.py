"""Read a llama.cpp GGUF file: model config, tokenizer metadata and dequantized tensors.

Tensors come back under Hugging Face names and layouts; llama.cpp's q/k row permutation (which
interleaves the two rotary halves of each head) is undone so that the HF "rotate half" RoPE
applies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling

log = logging.getLogger(__name__)

_GGUF_TO_HF_LAYER = {
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
_GGUF_TO_HF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows: [n_heads * 2 * half, ...] interleaved -> halves."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFModel:
    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # HF name -> gguf ReaderTensor

    def get(self, hf_name: str) -> np.ndarray:
        import gguf

        if hf_name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor for {hf_name} is missing")
        t = self.tensors[hf_name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot dequantize {t.name} "
                                  f"({t.tensor_type.name}): {e}") from e
        w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        if hf_name.endswith("q_proj.weight"):
            w = _unpermute(w, self.config.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _unpermute(w, self.config.num_kv_heads)
        return w


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_gguf(path: str | Path, dtype: str = "float32") -> GGUFModel:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        import gguf

        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises bare ValueError/IndexError/struct errors
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e

    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path}: truncated: tensor {t.name} needs bytes up to "
                                  f"{t.data_offset + t.n_bytes}, file has {size}")

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported architecture {arch!r} "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    metadata = {k: _field(reader, k) for k in reader.fields
                if not k.startswith("tokenizer.ggml.") and not k.startswith("GGUF.")}

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise CheckpointError(f"{path}: metadata key {arch}.{key} is missing")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else 0))
    scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none", "llama3"):
        raise CheckpointError(f"{path}: unsupported rope scaling type {scaling_type!r} in "
                              f"{arch}.rope.scaling.type (supported: none, llama3)")
    by_name = {t.name: t for t in reader.tensors}
    freq_factors = None
    if "rope_freqs.weight" in by_name:
        # llama.cpp's form of Llama 3.1/3.2 scaling: one divisor per rotary frequency
        t = by_name["rope_freqs.weight"]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        freq_factors = tuple(float(f) for f in w.reshape(-1))
    elif scaling_type == "llama3":  # rarely stored as metadata; llama.cpp writes rope_freqs instead
        scaling = RopeScaling(
            factor=float(_field(reader, f"{arch}.rope.scaling.factor")),
            low_freq_factor=float(_field(reader, f"{arch}.rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(_field(reader, f"{arch}.rope.scaling.high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                _field(reader, f"{arch}.rope.scaling.original_context_length", 8192)),
        )
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
    try:
        config = ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=freq_factors,
            rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in by_name,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            dtype=dtype,
        )
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e

    tensors: dict[str, Any] = {}
    unmapped = []
    for t in reader.tensors:
        if t.name in _GGUF_TO_HF_TOP:
            tensors[_GGUF_TO_HF_TOP[t.name]] = t
        elif t.name.startswith("blk."):
            _, i, kind, suffix = t.name.split(".", 3)
            if kind in _GGUF_TO_HF_LAYER:
                tensors[f"model.layers.{i}.{_GGUF_TO_HF_LAYER[kind]}.{suffix}"] = t
            else:
                unmapped.append(t.name)
        elif t.name != "rope_freqs.weight":  # read into the config above
            unmapped.append(t.name)
    if unmapped:
        log.warning("%s: ignoring %d tensor(s) this converter does not use: %s", path,
                    len(unmapped), ", ".join(unmapped[:8]) + (" ..." if len(unmapped) > 8 else ""))
    return GGUFModel(path=path, config=config, metadata=metadata, tensors=tensors)


def gguf_tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF file (vocabulary, merges, ids, chat template)."""
    import gguf

    reader = gguf.GGUFReader(Path(path))
    out: dict[str, Any] = {}
    for k in reader.fields:
        if k.startswith("tokenizer."):
            out[k] = _field(reader, k)
    return out
