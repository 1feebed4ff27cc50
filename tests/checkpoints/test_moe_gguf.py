"""Mixture-of-experts GGUF files as llama.cpp lays them out, written here from tiny random HF
models: Mixtral as `llama` with `llama.expert_count` (q/k rows permuted), Qwen2-MoE as
`qwen2moe` (q/k/v biases, shared expert `ffn_*_shexp` and its gate `ffn_gate_inp_shexp`),
Qwen3-MoE as `qwen3moe` (per-head `attn_q_norm` / `attn_k_norm`); each
layer's experts stacked in `ffn_{gate,up,down}_exps`, the router in `ffn_gate_inp`.
`convert gguf` of each matches transformers' logits of the HF model it was written from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import finish_gguf, full_logits, max_rel_error
from tests.moe_models import MOE_VARIANTS, hf_moe_model
from xlaserve.checkpoints.convert import convert_gguf
from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.serving.loading import load_model

HEADS, KV_HEADS = 4, 2

_ATTENTION = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm"}
_MIXTRAL = {"block_sparse_moe.gate": "ffn_gate_inp", "w1": "ffn_gate_exps",
            "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_QWEN = {"mlp.gate": "ffn_gate_inp", "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
         "down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its `llama` architecture (convert_hf_to_gguf `permute`)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(hf, path: Path) -> None:
    """`hf` (a transformers Mixtral, Qwen2/3-MoE or OLMoE) as llama.cpp's converter writes it (F32),
    from the checkpoint save_pretrained writes (per-expert tensors, HF names)."""
    import gguf
    from safetensors.numpy import load_file

    hf.save_pretrained(path.parent / "hf")
    state = load_file(path.parent / "hf" / "model.safetensors")

    c = hf.config
    mixtral = c.model_type == "mixtral"
    arch = _ARCH[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_expert_count(c.num_local_experts if mixtral else c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if not mixtral:   # OLMoE's experts are intermediate_size wide
        w.add_expert_feed_forward_length(getattr(c, "moe_intermediate_size", c.intermediate_size))
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(0x100 + i) for i in range(256)])
    w.add_token_types([gguf.TokenType.NORMAL] * 256)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", state.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", state.pop("model.norm.weight"))
    w.add_tensor("output.weight", state.pop("lm_head.weight"))
    experts = _MIXTRAL if mixtral else _QWEN
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf_name, kind in {**_ATTENTION, **experts}.items():
            for suffix in ("weight", "bias"):
                t = state.pop(f"{prefix}{hf_name}.{suffix}", None)
                if t is None:
                    continue
                if mixtral and kind in ("attn_q", "attn_k"):
                    t = _permute(t, HEADS if kind == "attn_q" else KV_HEADS)
                if kind == "ffn_gate_inp_shexp":
                    t = t.reshape(-1)                      # llama.cpp: {n_embd}
                w.add_tensor(f"blk.{i}.{kind}.{suffix}", np.ascontiguousarray(t, np.float32))
        # every expert's matrix stacked: [X, F, E] (gate, up) and [X, E, F] (down)
        moe = "block_sparse_moe.experts" if mixtral else "mlp.experts"
        for name, kind in experts.items():
            if not kind.endswith("_exps"):
                continue
            stack = [state.pop(f"{prefix}{moe}.{j}.{name}.weight")
                     for j in range(w_count(c))]
            w.add_tensor(f"blk.{i}.{kind}.weight", np.ascontiguousarray(np.stack(stack)))
    assert not state, f"tensors left unwritten: {sorted(state)[:4]}"
    finish_gguf(w)


def w_count(c) -> int:
    return c.num_local_experts if c.model_type == "mixtral" else c.num_experts


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe-shared", "qwen3-moe", "olmoe"])
def test_moe_gguf_matches_transformers(name: str, tmp_path: Path) -> None:
    hf = hf_moe_model(MOE_VARIANTS[name])
    path = tmp_path / f"{name}.gguf"
    write_moe_gguf(hf, path)
    convert_gguf(path, tmp_path / "ours", quiet=True)
    model = load_model(tmp_path / "ours")
    c = model.config
    assert c.is_moe and c.num_experts == w_count(hf.config)
    assert c.architecture == hf.config.model_type
    assert c.norm_topk_prob == MOE_VARIANTS[name].get("norm_topk_prob", True)
    assert c.shared_expert_intermediate_size == (80 if name == "qwen2-moe-shared" else 0)
    assert c.qk_norm == (name in ("qwen3-moe", "olmoe"))
    assert c.qk_norm_span == ("all" if name == "olmoe" else "head")
    ids = np.random.default_rng(4).integers(0, 256, size=60).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert max_rel_error(full_logits(model.params, c, ids), ref) < 1e-5
    assert max_rel_error(full_logits(model.params, c, ids, chunk=7), ref) < 1e-5


def test_moe_gguf_missing_expert_count(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "no-experts.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(8)])
    w.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    finish_gguf(w)
    with pytest.raises(CheckpointError, match=r"no-experts\.gguf: qwen2moe\.expert_count is "
                                              r"missing"):
        convert_gguf(path, tmp_path / "out", quiet=True)
