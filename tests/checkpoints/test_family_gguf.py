"""The dense families as llama.cpp's converter writes them into GGUF (F32), written here from
the tiny random transformers models of tests/family_models.py: Gemma's norms stored as 1 + w,
Granite's q/k rows permuted as Llama's, Phi-3's fused qkv and gate_up as they are with its
LongRoPE factors as tensors, each family's metadata keys (checkpoints/gguf_families.py).
`convert gguf` of each matches transformers' logits of the model it was written from.  Gemma's
GGUF has no query_pre_attn_scalar, so its models here use head_dim (llama.cpp's rule)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.family_models import FAMILY_VARIANTS, hf_family_model
from tests.helpers import finish_gguf, full_logits, max_rel_error
from xlaserve.checkpoints.convert import convert_gguf, convert_hf
from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.checkpoints.gguf_families import layer_names
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import pack_params
from xlaserve.models.families import config_from_hf
from xlaserve.serving.loading import load_model

_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3",
         "phi3": "phi3", "granite": "granite"}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for `llama` / `granite` (convert_hf_to_gguf `permute`)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(w, hf_config, ours: ModelConfig) -> None:
    import gguf

    c, arch = hf_config.to_dict(), _ARCH[hf_config.model_type]
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(ours.head_dim)
    w.add_value_length(ours.head_dim)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(ours.rope_theta)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(c["sliding_window"])
        w.add_sliding_window_pattern([k == "sliding" for k in ours.layer_kinds])
        if c.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
        if ours.rope_scaling is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(ours.rope_scaling.factor)
    if arch == "phi3":
        w.add_rope_dimension_count(ours.rotary_dim or ours.head_dim)
        w.add_sliding_window(c.get("sliding_window") or 0)
        if ours.rope_scaling is not None:
            w.add_rope_scaling_orig_ctx_len(ours.rope_scaling.original_max_position_embeddings)
            w.add_rope_scaling_attn_factors(ours.rope_scaling.attention_factor)
    if arch == "granite":
        w.add_attention_scale(c["attention_multiplier"])
        w.add_embedding_scale(c["embedding_multiplier"])
        w.add_residual_scale(c["residual_multiplier"])
        w.add_logit_scale(c["logits_scaling"])


def write_family_gguf(hf, path: Path) -> None:
    """`hf` as llama.cpp's converter writes it, from the checkpoint save_pretrained writes."""
    import gguf
    from safetensors.numpy import load_file

    hf.save_pretrained(path.parent / "hf")
    state = load_file(path.parent / "hf" / "model.safetensors")
    ours = config_from_hf(hf.config.to_dict())
    arch = _ARCH[hf.config.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, hf.config, ours)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(0x100 + i) for i in range(256)])
    w.add_token_types([gguf.TokenType.NORMAL] * 256)
    w.add_eos_token_id(2)
    gemma = arch.startswith("gemma")

    def put(name: str, t: np.ndarray) -> None:
        if gemma and name.endswith("norm.weight"):
            t = t + 1.0
        w.add_tensor(name, np.ascontiguousarray(t, np.float32))

    put("token_embd.weight", state.pop("model.embed_tokens.weight"))
    put("output_norm.weight", state.pop("model.norm.weight"))
    if "lm_head.weight" in state:
        put("output.weight", state.pop("lm_head.weight"))
    rs = ours.rope_scaling
    if rs is not None and rs.kind == "longrope":
        put("rope_factors_long.weight", np.asarray(rs.long_factor, np.float32))
        put("rope_factors_short.weight", np.asarray(rs.short_factor, np.float32))
    for i in range(ours.num_layers):
        for kind, hf_name in layer_names(arch).items():
            for suffix in ("weight", "bias"):
                t = state.pop(f"model.layers.{i}.{hf_name}.{suffix}", None)
                if t is None:
                    continue
                if arch == "granite" and kind in ("attn_q", "attn_k"):
                    t = _permute(t, ours.num_heads if kind == "attn_q" else ours.num_kv_heads)
                put(f"blk.{i}.{kind}.{suffix}", t)
    assert not state, f"tensors left unwritten: {sorted(state)[:4]}"
    finish_gguf(w)


def _close(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 * max(abs(a), abs(b))
    if isinstance(b, dict):   # a RopeScaling
        return all(_close(getattr(a, k), v) for k, v in b.items())
    if isinstance(b, (list, tuple)) and a is not None:
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", sorted(FAMILY_VARIANTS))
def test_family_gguf_matches_transformers(name: str, tmp_path: Path) -> None:
    variant = dict(FAMILY_VARIANTS[name])
    if variant["model_type"].startswith("gemma"):
        variant["query_pre_attn_scalar"] = variant["head_dim"]
    hf = hf_family_model(variant)
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(hf, path)
    convert_gguf(path, tmp_path / "ours", quiet=True)
    model = load_model(tmp_path / "ours")
    want = config_from_hf(hf.config.to_dict())
    got = model.config
    for key, value in want.to_dict().items():   # GGUF metadata is float32
        if key not in ("bos_token_id", "eos_token_ids"):
            assert _close(getattr(got, key), value), (key, getattr(got, key), value)
    ids = np.random.default_rng(4).integers(3, 256, size=100).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert max_rel_error(full_logits(model.params, got, ids), ref) < 1e-4
    packed = pack_params(model.params)   # the CPU kernels, in chunks and token by token
    assert max_rel_error(full_logits(packed, got, ids, chunk=23, backend="cpu"), ref) < 1e-4
    assert max_rel_error(full_logits(packed, got, ids[:24], chunk=1, backend="cpu"),
                         ref[:24]) < 1e-4


def test_gguf_missing_family_tensor_is_named(tmp_path: Path) -> None:
    """A Gemma 2 GGUF without one layer's post-MLP norm: one error naming that tensor."""
    import gguf

    variant = {**FAMILY_VARIANTS["gemma2-d256"], "query_pre_attn_scalar": 256}
    full = tmp_path / "full.gguf"
    write_family_gguf(hf_family_model(variant, layers=2), full)
    reader = gguf.GGUFReader(full)
    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    for key, f in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(key, f.contents(), f.types[0], f.types[-1]
                            if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name != "blk.1.post_ffw_norm.weight":
            w.add_tensor(t.name, np.asarray(t.data))
    finish_gguf(w)
    with pytest.raises(CheckpointError, match=r"cut\.gguf: tensor blk\.1\.post_ffw_norm\.weight "
                                              r"\(for model\.layers\.1\.post_feedforward"):
        convert_gguf(path, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt_neox"}, r"unsupported model_type 'gpt_neox'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"unsupported rope scaling type 'yarn'"),
    ({"attention_bias": True, "model_type": "granite"}, r"granite: attention_bias=true"),
    ({"use_sliding_window": True}, r"qwen2: use_sliding_window=true"),
])
def test_hf_config_refused_by_name(tmp_path: Path, change: dict, message: str) -> None:
    """An unsupported family, RoPE scaling or family option: one error naming it, from
    config.json, before a tensor is read."""
    import json

    hf = hf_family_model(FAMILY_VARIANTS["qwen2-gqa"], layers=1)
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.pop("rope_parameters", None) if "rope_scaling" in change else None
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=rf"config\.json: ValueError: .*{message}"):
        convert_hf(tmp_path / "hf", tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()
