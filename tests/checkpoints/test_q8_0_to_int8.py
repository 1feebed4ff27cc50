"""GGUF Q8_0 tensors land in xlaserve's int8 format exactly: a Q8_0 block is 32 weights along
the row (the matmul's contraction axis, GGUF's ne0) with d = max |w| / 127 stored as float16,
which is what `quantize_int8` computes for a group of 32 along K.  `convert gguf --quantize
int8` copies Q8_0 matrices as they are (no float round trip); a stack with other types in it
goes through float, where Q8_0 blocks requantize to their own q and d."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, quants

from xlaserve.kernels.quantized import quantize_int8


def test_q8_0_blocks_requantize_to_their_own_values() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 256)).astype(np.float32) * 0.05   # [out, in] as GGUF stores
    w[3, 32:64] = 0.0                                              # an all-zero block
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)            # [48, 8 blocks x 34 bytes]
    blocks = raw.reshape(48, 8, 34)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)   # [48, 8]
    q = blocks[..., 2:].copy().view(np.int8).reshape(48, 256)                # [48, 256]
    dense = quants.dequantize(raw, GGMLQuantizationType.Q8_0)                # [48, 256] f32

    ours = quantize_int8(dense.T, axis=0)        # [in, out], grouped along the contraction
    nonzero = d > 0
    np.testing.assert_array_equal(ours["q"], q.T)
    np.testing.assert_array_equal(ours["scale"].T[nonzero], d[nonzero])
    assert (ours["scale"].T[~nonzero] == 1.0).all()   # ours marks an all-zero group with 1


# -- `xlaserve convert gguf --quantize int8` on a Q8_0 file: no float round trip --------------

E, F, L, H, KVH, D, V = 64, 96, 2, 2, 1, 32, 64     # head_dim 32: wo's groups stay in a head
HF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
OURS = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
        "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}
SHAPES = {"attn_q": (H * D, E), "attn_k": (KVH * D, E), "attn_v": (KVH * D, E),
          "attn_output": (E, H * D), "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py `permute`)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 bytes [rows, in/32 * 34] -> (q [rows, in] int8, d [rows, in/32] float32)."""
    b = raw.reshape(rows, -1, 34)
    return (b[..., 2:].copy().view(np.int8).reshape(rows, -1),
            b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))


def write_llama_gguf(path, types: dict[str, GGMLQuantizationType]) -> dict[str, np.ndarray]:
    """A tiny random Llama as llama.cpp lays one out (q/k rows permuted, [out, in] rows along
    ne0), each tensor in `types[gguf name]` (default Q8_0 for matrices, F32 for norms).
    Returns the stored bytes of each tensor by GGUF name."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_context_length, 128), (w.add_embedding_length, E),
                   (w.add_feed_forward_length, F), (w.add_block_count, L),
                   (w.add_head_count, H), (w.add_head_count_kv, KVH),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_tokenizer_model, "gpt2"),
                   (w.add_token_list, [chr(ord("a") + i % 26) * (1 + i // 26)
                                       for i in range(V)]), (w.add_eos_token_id, 0)):
        add(v)
    tensors = {"token_embd.weight": rng.standard_normal((V, E)),
               "output.weight": rng.standard_normal((V, E)) * 0.1,
               "output_norm.weight": 1 + 0.1 * rng.standard_normal(E)}
    for i in range(L):
        tensors[f"blk.{i}.attn_norm.weight"] = 1 + 0.1 * rng.standard_normal(E)
        tensors[f"blk.{i}.ffn_norm.weight"] = 1 + 0.1 * rng.standard_normal(E)
        for kind, shape in SHAPES.items():
            t = rng.standard_normal(shape) * 0.1
            t[0, :32] = 0.0                                   # one all-zero block: d = 0
            if kind in ("attn_q", "attn_k"):
                t = _permute(t, H if kind == "attn_q" else KVH)
            tensors[f"blk.{i}.{kind}.weight"] = t
    stored = {}
    for name, t in tensors.items():
        kind = types.get(name, GGMLQuantizationType.F32 if t.ndim == 1
                         else GGMLQuantizationType.Q8_0)
        t = t.astype(np.float32)
        if kind == GGMLQuantizationType.F32:
            stored[name] = t
            w.add_tensor(name, t)
        elif kind == GGMLQuantizationType.F16:
            stored[name] = t.astype(np.float16)
            w.add_tensor(name, stored[name])
        else:
            stored[name] = quants.quantize(t, kind)
            w.add_tensor(name, stored[name], raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _as_hf(name: str, a: np.ndarray) -> np.ndarray:
    """One layer of our q or scale back in the file's [out, in (or in / 32)] layout."""
    if name in ("wq", "wk", "wv"):        # [E(/32), heads, D] -> [heads*D, E(/32)]
        return a.reshape(a.shape[0], -1).T
    if name == "wo":                      # [H, D(/32), E] -> [E, H*D(/32)]
        return a.reshape(-1, a.shape[-1]).T
    return a.T                            # [in(/32), out] -> [out, in(/32)]


def _load(folder):
    from xlaserve.checkpoints.store import load_config, load_params
    from xlaserve.sharding.mesh import make_mesh

    config = load_config(folder)
    return config, jax.tree_util.tree_map(np.asarray, load_params(folder, config, make_mesh()))


def _file_layer(stored, kind: str, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer i's Q8_0 tensor `kind` as the file holds it, q/k rows un-permuted by the test's
    own permutation's inverse (permute . permute^-1 checked below on the bytes)."""
    return _blocks(stored[f"blk.{i}.{kind}.weight"], SHAPES[kind][0])


def test_q8_0_gguf_converts_to_int8_byte_for_byte(tmp_path, monkeypatch) -> None:
    """Every matrix of a Q8_0 file lands as the file's int8 values and its f16 scales widened
    to float32 (q/k rows in HF order), none of them dequantized on the way, and the int8
    model's logits equal those of the same file converted to float (Q8_0 dequantized) within
    float32 rounding."""
    from tests.helpers import full_logits, max_rel_error
    from xlaserve.checkpoints.convert import convert_gguf
    from xlaserve.checkpoints.gguf_file import GGUFModel
    from xlaserve.kernels.cpu import build
    from xlaserve.models.llama import pack_params

    stored = write_llama_gguf(tmp_path / "q8.gguf", {})
    dequantized = []
    real = GGUFModel._dequantize
    monkeypatch.setattr(GGUFModel, "_dequantize",
                        lambda self, t: dequantized.append(t.name) or real(self, t))
    config = convert_gguf(tmp_path / "q8.gguf", tmp_path / "int8", quiet=True, quantize="int8")
    assert config.quantization == "int8"
    assert sorted(dequantized) == sorted(n for n in stored if "norm" in n or "embd" in n)
    monkeypatch.undo()
    convert_gguf(tmp_path / "q8.gguf", tmp_path / "float", quiet=True)
    config, params = _load(tmp_path / "int8")
    float_config, float_params = _load(tmp_path / "float")

    for kind, ours in OURS.items():
        for i in range(L):
            q_file, d_file = _file_layer(stored, kind, i)
            q = _as_hf(ours, params["layers"][ours]["q"][i])
            s = _as_hf(ours, params["layers"][ours]["scale"][i])
            if kind in ("attn_q", "attn_k"):    # ours are in HF order: llama.cpp's again
                n = H if kind == "attn_q" else KVH
                q, s = _permute(q, n), _permute(s, n)
            assert q.dtype == np.int8 and s.dtype == np.float32
            np.testing.assert_array_equal(q, q_file, err_msg=f"{kind} layer {i}")
            np.testing.assert_array_equal(s, d_file, err_msg=f"{kind} layer {i}")
            assert (d_file[0, 0] == 0) and (q_file[0, :32] == 0).all()   # kept as stored
    q_file, d_file = _blocks(stored["output.weight"], V)
    np.testing.assert_array_equal(params["lm_head"]["q"].T, q_file)
    np.testing.assert_array_equal(params["lm_head"]["scale"].T, d_file)
    # the embedding is gathered, not streamed: it stays float (Q8_0 dequantized)
    np.testing.assert_array_equal(params["embed"], float_params["embed"])

    ids = list(np.random.default_rng(1).integers(0, V, 24))
    want = full_logits(float_params, float_config, ids)
    assert max_rel_error(full_logits(params, config, ids), want) < 1e-5
    if build.load() is not None:       # the CPU kernels on the packed int8 panels
        got = full_logits(pack_params(jax.tree_util.tree_map(jnp.asarray, params)), config,
                          ids, backend="cpu")
        assert max_rel_error(got, want) < 1e-5


def test_mixed_gguf_keeps_q8_0_stacks_and_quantizes_the_rest(tmp_path, caplog) -> None:
    """A stack is copied as int8 only when every layer's tensor is Q8_0: attn_v with one Q4_0
    layer, ffn_down in F32 and an F16 output head go through float and are quantized like any
    float weight (the Q8_0 layer of attn_v then requantizes to its own q and d); the rest of
    the file's Q8_0 matrices are its bytes."""
    from xlaserve.checkpoints.convert import convert_gguf
    from xlaserve.models.quantize import GROUP_AXIS

    Q = GGMLQuantizationType
    types = {"blk.1.attn_v.weight": Q.Q4_0, "output.weight": Q.F16,
             **{f"blk.{i}.ffn_down.weight": Q.F32 for i in range(L)}}
    stored = write_llama_gguf(tmp_path / "mixed.gguf", types)
    with caplog.at_level("INFO", logger="xlaserve.checkpoints.layout"):
        convert_gguf(tmp_path / "mixed.gguf", tmp_path / "int8", quiet=True, quantize="int8")
    assert ("matrices read as the int8 they are stored in: wq, wk, wo, w_gate, w_up; "
            "read as float: wv, w_down, lm_head") in caplog.text
    _, params = _load(tmp_path / "int8")
    for kind in ("attn_q", "attn_output", "ffn_up"):
        q_file, _ = _file_layer(stored, kind, 1)
        q = _as_hf(OURS[kind], params["layers"][OURS[kind]]["q"][1])
        np.testing.assert_array_equal(_permute(q, H) if kind == "attn_q" else q, q_file)
    dense = {
        "wv": [quants.dequantize(stored[f"blk.{i}.attn_v.weight"], Q.Q8_0 if i == 0 else Q.Q4_0)
               for i in range(L)],
        "w_down": [stored[f"blk.{i}.ffn_down.weight"] for i in range(L)],
    }
    for ours, layers in dense.items():
        for i, w in enumerate(layers):
            want = quantize_int8(w.reshape(SHAPES["attn_v" if ours == "wv" else "ffn_down"]).T,
                                 axis=0)
            got_q = _as_hf(ours, params["layers"][ours]["q"][i]).T
            got_s = _as_hf(ours, params["layers"][ours]["scale"][i]).T
            np.testing.assert_array_equal(got_q, want["q"], err_msg=f"{ours} layer {i}")
            np.testing.assert_allclose(got_s, want["scale"], rtol=1e-6)
            assert GROUP_AXIS[ours] == 1
    q_file, d_file = _file_layer(stored, "attn_v", 0)   # Q8_0 -> float -> int8: the same q
    np.testing.assert_array_equal(_as_hf("wv", params["layers"]["wv"]["q"][0]), q_file)
    head = quantize_int8(stored["output.weight"].astype(np.float32).T, axis=0)
    np.testing.assert_array_equal(params["lm_head"]["q"], head["q"])
