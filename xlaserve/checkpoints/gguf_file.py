"""Read a llama.cpp GGUF file: model config, tokenizer metadata and dequantized tensors.

Tensors come back under Hugging Face names and layouts; llama.cpp's q/k row permutation (which
interleaves the two rotary halves of each head, `llama` architecture only) is undone so that the
HF "rotate half" RoPE applies.

`GGUFModel.get` dequantizes any tensor type to float32.  `GGUFModel.get_int8` reads a Q8_0
tensor as it is stored: a Q8_0 block is 32 int8 weights along the row (GGUF's ne0, the
matmul's contraction axis) and one float16 scale d, w = d * q, which is xlaserve's int8 format
(kernels/quantized.py, groups of 32 along K): q comes back as the file's bytes and d widened to
float32, never through a float weight.  Un-permuting q/k rows moves whole rows, so each row's
scales move with it.

Mixture-of-experts files: llama.cpp writes Mixtral as `llama` with `llama.expert_count`, and
Qwen2-MoE / Qwen3-MoE / OLMoE as `qwen2moe` / `qwen3moe` / `olmoe` (whose `attn_q_norm` /
`attn_k_norm` span every head: [H*D], [K*D]).  Each layer's experts are one stacked tensor
per matrix (`ffn_gate_exps`, `ffn_up_exps` [X, F, E], `ffn_down_exps` [X, E, F] as numpy
shapes), the router `ffn_gate_inp` [X, E], Qwen2-MoE's shared expert `ffn_*_shexp` and its gate
`ffn_gate_inp_shexp` [E]; expert j of a stacked tensor is served under its HF per-expert name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.checkpoints.gguf_families import (
    GGUF_ARCHITECTURES,
    PERMUTED_QK,
    family_fields,
    layer_names,
)
from xlaserve.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling

# MoE tensors: llama.cpp kind -> our parameter name (its HF name from checkpoints/layout.py).
_GGUF_MOE = {"ffn_gate_inp": "router", "ffn_gate_exps": "we_gate", "ffn_up_exps": "we_up",
             "ffn_down_exps": "we_down", "ffn_gate_shexp": "ws_gate", "ffn_up_shexp": "ws_up",
             "ffn_down_shexp": "ws_down", "ffn_gate_inp_shexp": "ws_router",
             "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}

log = logging.getLogger(__name__)

_GGUF_TO_HF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# top-level tensors that become config fields (RoPE scalings), not parameters
_READ_INTO_CONFIG = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


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
    # HF per-expert name -> (stacked ReaderTensor, expert index)
    experts: dict[str, tuple[Any, int]] = field(default_factory=dict)
    permuted_qk: bool = True   # llama.cpp permuted q/k rows (its `llama`, `granite`)
    residual_multiplier: float = 1.0   # Granite's residual_scale (checkpoints/family_tensors.py)
    _last: tuple[str, np.ndarray] | None = None   # the stacked tensor dequantized last

    def _dequantize(self, t: Any) -> np.ndarray:
        import gguf

        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot dequantize {t.name} "
                                  f"({t.tensor_type.name}): {e}") from e
        return np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])

    def get_int8(self, hf_name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """A Q8_0 tensor as (q [out, in] int8, scale [out, in / 32] float32), the file's
        values (q/k rows un-permuted like `get`); None for any other type (or an expert)."""
        import gguf

        t = self.tensors.get(hf_name)
        if t is None or t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            return None
        shape = [int(x) for x in reversed(t.shape)]                      # [out, in]
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]                # 32 weights, 34 B
        blocks = np.asarray(t.data, np.uint8).reshape(-1, size)           # [out * in / 32, 34]
        d = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
        q = blocks[:, 2:].copy().view(np.int8)                            # [out * in / 32, 32]
        q, d = q.reshape(shape), d.reshape(*shape[:-1], shape[-1] // block)
        if self.permuted_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_heads if hf_name.endswith("q_proj.weight") \
                else self.config.num_kv_heads
            q, d = _unpermute(q, heads), _unpermute(d, heads)
        return q, d

    def get(self, hf_name: str) -> np.ndarray:
        if hf_name in self.experts:   # experts are read in order: dequantize each stack once
            t, j = self.experts[hf_name]
            if self._last is None or self._last[0] != t.name:
                self._last = (t.name, self._dequantize(t))
            return self._last[1][j]
        if hf_name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {gguf_name(hf_name, self.config)} "
                                  f"(for {hf_name}) is missing")
        w = self._dequantize(self.tensors[hf_name])
        if not self.permuted_qk:
            return w
        if hf_name.endswith("q_proj.weight"):
            w = _unpermute(w, self.config.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _unpermute(w, self.config.num_kv_heads)
        return w


def gguf_name(hf_name: str, config: ModelConfig) -> str:
    """The GGUF tensor name llama.cpp gives `hf_name` (for error messages)."""
    top = {hf: g for g, hf in _GGUF_TO_HF_TOP.items()}
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        inner, suffix = ".".join(parts[3:-1]), parts[-1]
        kinds = {hf: g for g, hf in layer_names(config.architecture).items()}
        if inner in kinds:
            return f"blk.{parts[2]}.{kinds[inner]}.{suffix}"
    return hf_name


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_gguf(path: str | Path, dtype: str = "float32") -> GGUFModel:
    path = Path(path)
    reader = _open(path)
    arch = _field(reader, "general.architecture")
    if GGUF_ARCHITECTURES.get(arch) not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported architecture {arch!r} "
                              f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    metadata = {k: _field(reader, k) for k in reader.fields
                if not k.startswith("tokenizer.ggml.") and not k.startswith("GGUF.")}
    by_name = {t.name: t for t in reader.tensors}
    try:
        config = _config(reader, path, arch, by_name, dtype)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e
    tensors, experts = _layer_tensors(reader, path, config)
    return GGUFModel(path=path, config=config, metadata=metadata, tensors=tensors,
                     experts=experts, permuted_qk=arch in PERMUTED_QK,
                     residual_multiplier=float(_field(reader, f"{arch}.residual_scale", 1.0)))


def _open(path: Path) -> Any:
    """A GGUFReader of `path`, its tensors checked to lie inside the file."""
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
    return reader


def _values(t: Any) -> list[float]:
    import gguf

    return [float(f) for f in np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                         np.float32).reshape(-1)]


def _rope(reader: Any, path: Path, arch: str, by_name: dict[str, Any]
          ) -> tuple[RopeScaling | None, tuple[float, ...] | None]:
    """The RoPE scaling of the metadata, or llama.cpp's `rope_freqs` divisors."""
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none", "llama3", "linear"):
        raise CheckpointError(f"{path}: unsupported rope scaling type {scaling_type!r} in "
                              f"{arch}.rope.scaling.type (supported: none, llama3, linear)")
    if "rope_freqs.weight" in by_name:
        # llama.cpp's form of Llama 3.1/3.2 scaling: one divisor per rotary frequency
        return None, tuple(_values(by_name["rope_freqs.weight"]))
    key = f"{arch}.rope.scaling"
    if scaling_type == "linear":   # Gemma 3's full layers
        return RopeScaling(kind="linear", factor=float(_field(reader, f"{key}.factor", 1.0))), None
    if scaling_type == "llama3":  # rarely stored as metadata; llama.cpp writes rope_freqs instead
        return RopeScaling(
            factor=float(_field(reader, f"{key}.factor")),
            low_freq_factor=float(_field(reader, f"{key}.low_freq_factor", 1.0)),
            high_freq_factor=float(_field(reader, f"{key}.high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                _field(reader, f"{key}.original_context_length", 8192))), None
    return None, None


def _config(reader: Any, path: Path, arch: str, by_name: dict[str, Any],
            dtype: str) -> ModelConfig:
    """ModelConfig of the metadata (ValueError where the config refuses a value)."""
    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise CheckpointError(f"{path}: metadata key {arch}.{key} is missing")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    layers = int(need("block_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    scaling, freq_factors = _rope(reader, path, arch, by_name)
    stops = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ours = GGUF_ARCHITECTURES[arch]
    fields = dict(rope_scaling=scaling, attention_bias=ours in ("qwen2", "qwen3")
                  and "blk.0.attn_q.bias" in by_name)
    fields.update(family_fields(
        ours, lambda key, default: _field(reader, f"{arch}.{key}", default),
        dict(hidden=hidden, heads=heads, head_dim=head_dim, layers=layers),
        lambda name: _values(by_name[name]) if name in by_name else None))
    moe = _moe_config(reader, arch, by_name)
    fields.update(attention_bias=moe.pop("attention_bias", fields["attention_bias"]))
    return ModelConfig(
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_freq_factors=freq_factors,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in by_name,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        # eot, eom: the end of a turn, of a message (Llama 3.1)
        eos_token_ids=tuple(dict.fromkeys(int(x) for x in stops if x is not None)),
        dtype=dtype, **moe, **fields)


def _layer_tensors(reader: Any, path: Path, config: ModelConfig
                   ) -> tuple[dict[str, Any], dict[str, tuple[Any, int]]]:
    """The file's tensors by HF name, and its stacked experts' (tensor, expert) by the HF
    per-expert name; any tensor the config does not use is logged once."""
    moe_names = {}
    if config.is_moe:
        from xlaserve.checkpoints.layout import layer_tensors

        moe_names = {kind: layer_tensors(config)[ours] for kind, ours in _GGUF_MOE.items()
                     if ours in layer_tensors(config)}
    names = layer_names(config.architecture)
    tensors: dict[str, Any] = {}
    experts: dict[str, tuple[Any, int]] = {}
    unmapped = []
    for t in reader.tensors:
        if t.name in _GGUF_TO_HF_TOP:
            tensors[_GGUF_TO_HF_TOP[t.name]] = t
        elif t.name.startswith("blk."):
            _, i, kind, suffix = t.name.split(".", 3)
            if kind in moe_names and kind.endswith("_exps"):
                for j in range(config.num_experts):
                    experts[f"model.layers.{i}.{moe_names[kind].format(j=j)}"] = (t, j)
            elif kind in moe_names:
                tensors[f"model.layers.{i}.{moe_names[kind]}"] = t
            elif kind in names:
                tensors[f"model.layers.{i}.{names[kind]}.{suffix}"] = t
            else:
                unmapped.append(t.name)
        elif t.name not in _READ_INTO_CONFIG:
            unmapped.append(t.name)
    if unmapped:
        log.warning("%s: ignoring %d tensor(s) this converter does not use: %s", path,
                    len(unmapped), ", ".join(unmapped[:8]) + (" ..." if len(unmapped) > 8 else ""))
    return tensors, experts


def _moe_config(reader: Any, arch: str, by_name: dict[str, Any]) -> dict[str, Any]:
    """The architecture and mixture-of-experts fields of ModelConfig from GGUF metadata."""
    count = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    ours = "mixtral" if arch == "llama" and count else GGUF_ARCHITECTURES[arch]
    if not count:
        if ours != arch:   # qwen2moe / qwen3moe without experts
            raise ValueError(f"{arch}.expert_count is missing")
        return {"architecture": ours}
    used = int(_field(reader, f"{arch}.expert_used_count", 0) or 0)
    ffn = _field(reader, f"{arch}.expert_feed_forward_length",
                 _field(reader, f"{arch}.feed_forward_length"))
    norm = _field(reader, f"{arch}.expert_weights_norm")
    out = dict(architecture=ours, num_experts=count, num_experts_per_tok=used,
               moe_intermediate_size=int(ffn),
               norm_topk_prob=bool(norm) if norm is not None
               else ours not in ("qwen2_moe", "olmoe"))
    if ours == "qwen2_moe":
        out.update(shared_expert_intermediate_size=int(
            _field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0),
            attention_bias="blk.0.attn_q.bias" in by_name)
    elif ours == "qwen3_moe":
        out.update(qk_norm=True, attention_bias="blk.0.attn_q.bias" in by_name)
    elif ours == "olmoe":   # attn_q_norm / attn_k_norm over all heads: [H*D], [K*D]
        out.update(qk_norm=True, qk_norm_span="all",
                   attention_bias="blk.0.attn_q.bias" in by_name)
    return out


def gguf_tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF file (vocabulary, merges, ids, chat template)."""
    import gguf

    reader = gguf.GGUFReader(Path(path))
    out: dict[str, Any] = {}
    for k in reader.fields:
        if k.startswith("tokenizer."):
            out[k] = _field(reader, k)
    return out
