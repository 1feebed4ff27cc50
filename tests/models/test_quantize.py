"""int8 weights through the model: the quantized pytree (shapes, axes, dtypes), its forward on
the CPU kernels against the float model of the same (dequantized) weights, checkpoints that
store it or quantize a float one as it loads, and SmolLM2's quality against float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.checkpoints.store import load_config, load_params, save_params
from xlaserve.kernels.cpu import build
from xlaserve.kernels.quantized import dequantize
from xlaserve.models.batch_metadata import one_row_metadata
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import (
    AttentionMetadata,
    forward,
    init_kv_cache,
    init_params,
    pack_params,
    param_axes,
    param_shapes,
)
from xlaserve.models.quantize import GROUP_AXIS, leaf_dtype, quantize_params, quantized_tree
from xlaserve.sharding.mesh import make_mesh

TINY = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True)
TINY_INT8 = TINY.replace(quantization="int8")


def dequantized(params: dict) -> dict:
    return quantized_tree(params, lambda w, axis: dequantize(w, axis))


def test_quantized_tree_shapes_axes_and_dtypes() -> None:
    params = init_params(TINY_INT8.replace(tie_word_embeddings=False), seed=1)
    shapes = param_shapes(TINY_INT8.replace(tie_word_embeddings=False))
    axes = param_axes(TINY_INT8.replace(tie_word_embeddings=False))
    got = jax.tree_util.tree_leaves_with_path(params)
    want = jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    assert [a.shape for _, a in got] == want
    for path, a in got:
        assert a.dtype == np.dtype(leaf_dtype(path, "float32")), jax.tree_util.keystr(path)
    for name, axis in GROUP_AXIS.items():
        q, s = params["layers"][name]["q"], params["layers"][name]["scale"]
        assert q.dtype == np.int8 and s.shape[axis] * 32 == q.shape[axis], name
        assert axes["layers"][name]["scale"] == axes["layers"][name]["q"], name
    assert params["lm_head"]["scale"].shape == (64 // 32, 96)
    assert params["embed"].dtype == np.float32 and params["final_norm"].dtype == np.float32


@pytest.mark.skipif(build.load() is None, reason="CPU kernels not built")
def test_int8_forward_on_the_kernels_matches_its_dequantized_float_model() -> None:
    params = init_params(TINY_INT8, seed=0, scale=0.2)
    bs, num_blocks = 8, 8
    tables = np.asarray([[3, 5], [2, 0]], np.int32)
    rows = np.asarray([0] * 7 + [1] * 4 + [-1] * 5, np.int32)
    positions = np.asarray(list(range(7)) + list(range(4)) + [0] * 5, np.int32)
    slots = np.where(rows >= 0, tables[np.maximum(rows, 0), positions // bs] * bs
                     + positions % bs, 0).astype(np.int32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, len(rows)), jnp.int32)
    meta = AttentionMetadata(jnp.asarray(tables), jnp.asarray(rows), jnp.asarray(slots))
    index = jnp.asarray([6, 10], jnp.int32)
    runs = {
        "int8 kernels": (pack_params(params), TINY_INT8, "cpu"),
        "int8 jnp": (params, TINY_INT8, "reference"),
        "float of the same weights": (dequantized(params), TINY, "reference"),
    }
    logits = {}
    for name, (p, config, backend) in runs.items():
        kv = init_kv_cache(config, num_blocks, bs)
        out, _ = forward(p, config, tokens, jnp.asarray(positions), kv, meta,
                         logits_index=index, attention_backend=backend)
        logits[name] = np.asarray(out)
    # The kernels' tied head is quantized at packing (groups along E), the others' is float:
    # compare the kernels with a float model whose table is that quantized head's.
    want = logits["float of the same weights"]
    np.testing.assert_allclose(logits["int8 jnp"], want, rtol=1e-5, atol=1e-5)
    head_error = float(np.abs(logits["int8 kernels"] - want).max())
    assert 0 < head_error < 2e-2 * float(np.abs(want).max()), head_error
    assert np.abs(want).max() > 0.1


def test_int8_weights_serve_in_bfloat16() -> None:
    """bfloat16 activations (`dtype auto` on a GPU) over int8 weights with float32 scales: the
    jnp path computes in the activations' dtype, close to the float32 run of the same model."""
    bf16 = TINY_INT8.replace(dtype="bfloat16")
    tokens = jnp.arange(8, dtype=jnp.int32)
    positions, meta = one_row_metadata(np.arange(1, 3, dtype=np.int32), 0, 5, 8, 8)
    meta = AttentionMetadata(*(jnp.asarray(a) for a in meta))
    logits = {}
    for config in (TINY_INT8, bf16):
        out, _ = forward(init_params(config, seed=0, scale=0.2), config, tokens,
                         jnp.asarray(positions), init_kv_cache(config, 4, 8), meta,
                         logits_index=jnp.asarray([4], jnp.int32),
                         attention_backend="reference")
        logits[config.dtype] = np.asarray(out, np.float32)
    want = logits["float32"]
    assert np.abs(logits["bfloat16"] - want).max() < 5e-2 * np.abs(want).max()


def test_checkpoints_store_int8_or_quantize_a_float_one_as_it_loads(tmp_path) -> None:
    mesh = make_mesh()
    float_params = init_params(TINY, seed=2)
    (tmp_path / "float").mkdir()
    save_params(tmp_path / "float", float_params)
    TINY.save(tmp_path / "float" / "config.json")
    (tmp_path / "int8").mkdir()
    save_params(tmp_path / "int8", quantize_params(float_params))
    TINY_INT8.save(tmp_path / "int8" / "config.json")
    want = quantize_params(float_params)

    for folder in ("float", "int8"):
        config = load_config(tmp_path / folder, quantization="int8")
        assert config.quantization == "int8"
        got = load_params(tmp_path / folder, config, mesh)
        flat_got = jax.tree_util.tree_leaves_with_path(got)
        flat_want = jax.tree_util.tree_leaves(want)
        for (path, g), w in zip(flat_got, flat_want):
            assert g.dtype == w.dtype, (folder, jax.tree_util.keystr(path))
            if g.dtype == np.int8:   # on device, x / s may round one step off at a tie
                assert np.abs(np.asarray(g, np.int32) - w).max() <= 1
            else:
                np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6)
    assert load_config(tmp_path / "int8").quantization == "int8"
    with pytest.raises(CheckpointError, match="holds int8 weights"):
        load_params(tmp_path / "int8", TINY, mesh)


@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=["int8 weights", "+ int8 KV"])
def test_smollm2_int8_quality_against_float32(smollm2, kv_dtype) -> None:
    """Teacher-forced on the shipped corpus (xlaserve bench quality): top-1 agreement >= 98%
    and perplexity within 2% of float32 (measured on the whole corpus: 98.9%, +0.1%; with the
    int8 KV cache too, 98.5%, +0.4%; BENCHMARKS.md).  And it is a quantized model: int8
    matrices whose logits move (mean |error| measured 0.14, 0.17 with the int8 KV cache), so
    a quantizer that changed nothing would fail here."""
    from xlaserve.bench.quality import CORPUS, teacher_forced
    from xlaserve.serving.loading import LoadedModel

    config = smollm2.config.replace(quantization="int8")
    quantized = jax.jit(quantize_params)(smollm2.params)
    int8 = LoadedModel(config, quantized, smollm2.tokenizer, smollm2.mesh)
    ids = smollm2.tokenizer.encode(CORPUS.read_text())[:769]
    got = teacher_forced((smollm2, int8), ids, window=256, kv_dtypes=(None, kv_dtype))
    print(f"SmolLM2 int8: {got}")
    assert quantized["layers"]["wq"]["q"].dtype == jnp.int8
    assert got["tokens"] == 768
    assert got["mean_logit_error"] >= 0.03
    assert got["top1_agreement"] >= 0.98
    assert abs(got["ppl_quantized"] / got["ppl_float"] - 1) <= 0.02


@pytest.mark.parametrize("kv_dtype,agreement", [("float16", 0.995), ("bfloat16", 0.99)])
def test_smollm2_16_bit_kv_cache_quality_against_float32(smollm2, kv_dtype, agreement) -> None:
    """The same float32 weights over a float16 (bfloat16) KV cache, teacher-forced on the
    shipped corpus: measured top-1 agreement 99.87% (99.61%), perplexity +0.01% (+0.02%)."""
    from xlaserve.bench.quality import CORPUS, teacher_forced

    ids = smollm2.tokenizer.encode(CORPUS.read_text())[:769]
    got = teacher_forced((smollm2, smollm2), ids, window=256, kv_dtypes=(None, kv_dtype))
    assert got["tokens"] == 768
    assert got["mean_logit_error"] > 0    # the cache did hold 16-bit rows
    assert got["top1_agreement"] >= agreement
    assert abs(got["ppl_quantized"] / got["ppl_float"] - 1) <= 0.002


# -- fp8 (e4m3) weights: a GPU option, run here through the jnp path (test-only override) ----

TINY_FP8 = TINY.replace(quantization="fp8")


def test_fp8_weights_store_restore_and_match_their_dequantized_float_model(
        tmp_path, monkeypatch) -> None:
    """The fp8 pytree (q float8_e4m3fn, float32 scales, int8's groups) saves and restores
    through orbax, a float folder quantizes to the same bytes as it loads, the jnp forward
    equals the float model of the dequantized weights, and serving it on CPU is refused
    without the override, naming the option."""
    from xlaserve.kernels.quantized import FP8_ON_CPU_ENV
    from xlaserve.serving.loading import load_model

    params = init_params(TINY_FP8.replace(tie_word_embeddings=False), seed=1)
    for path, a in jax.tree_util.tree_leaves_with_path(params):
        assert a.dtype == np.dtype(leaf_dtype(path, "float32", "fp8")), jax.tree_util.keystr(path)
    assert params["layers"]["wq"]["q"].dtype == jnp.float8_e4m3fn

    mesh = make_mesh()
    float_params = init_params(TINY, seed=2, scale=0.2)
    want = quantize_params(float_params, "fp8")
    for folder, stored, config in (("float", float_params, TINY), ("fp8", want, TINY_FP8)):
        (tmp_path / folder).mkdir()
        save_params(tmp_path / folder, stored)
        config.save(tmp_path / folder / "config.json")
        got = load_params(tmp_path / folder, load_config(tmp_path / folder, quantization="fp8"),
                          mesh)
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                                jax.tree_util.tree_leaves(want)):
            assert g.dtype == w.dtype, (folder, jax.tree_util.keystr(path))
            g = np.asarray(g)
            if folder == "fp8":            # restored as stored
                np.testing.assert_array_equal(g.view(np.uint8) if g.itemsize == 1 else g,
                                              w.view(np.uint8) if w.itemsize == 1 else w)
            elif g.dtype == jnp.float8_e4m3fn:   # on device x / s may round one code off
                codes = g.view(np.uint8).astype(np.int32) - w.view(np.uint8).astype(np.int32)
                assert np.abs(codes).max() <= 1 and (codes == 0).mean() > 0.99
            else:
                np.testing.assert_allclose(g, w, rtol=1e-6)
    with pytest.raises(ValueError, match=r"quantization='fp8' \(model .*fp8\) is a GPU option"):
        load_model(tmp_path / "fp8")

    monkeypatch.setenv(FP8_ON_CPU_ENV, "1")
    tokens = jnp.arange(8, dtype=jnp.int32)
    positions, meta = one_row_metadata(np.arange(1, 3, dtype=np.int32), 0, 7, 8, 8)
    meta = AttentionMetadata(*(jnp.asarray(a) for a in meta))
    logits = {}
    for name, p, config in (("fp8", want, TINY_FP8), ("float", dequantized(want), TINY)):
        out, _ = forward(p, config, tokens, jnp.asarray(positions), init_kv_cache(config, 4, 8),
                         meta, attention_backend="reference")
        logits[name] = np.asarray(out)[:7]
    np.testing.assert_allclose(logits["fp8"], logits["float"], rtol=1e-5,
                               atol=1e-5 * np.abs(logits["float"]).max())


def test_smollm2_fp8_quality_against_float32(smollm2, monkeypatch) -> None:
    """fp8 weights and the fp8 KV cache through the jnp path on CPU (the override),
    teacher-forced on 512 corpus tokens.  fp8 misses int8's bar (top-1 >= 98%): measured on
    the whole corpus (BENCHMARKS.md, "fp8") fp8 weights agree with float32 on 93.7% of next
    tokens at +2.0% perplexity; e4m3 keeps 3 mantissa bits, so every weight moves by up to
    6%, where int8's 127 steps per group of 32 move the large ones by < 0.4%.  The bounds
    here guard that measured level (this slice: ~92%, +3%), not the int8 bar."""
    from xlaserve.bench.quality import CORPUS, teacher_forced
    from xlaserve.kernels.quantized import FP8_ON_CPU_ENV
    from xlaserve.serving.loading import LoadedModel

    monkeypatch.setenv(FP8_ON_CPU_ENV, "1")
    config = smollm2.config.replace(quantization="fp8")
    fp8 = LoadedModel(config, jax.jit(lambda p: quantize_params(p, "fp8"))(smollm2.params),
                      smollm2.tokenizer, smollm2.mesh)
    ids = smollm2.tokenizer.encode(CORPUS.read_text())[:513]
    got = teacher_forced((smollm2, fp8), ids, window=256, backend="reference",
                         kv_dtypes=(None, "float8_e4m3fn"))
    print(f"SmolLM2 fp8 weights + fp8 KV: {got}")
    assert got["tokens"] == 512
    assert got["mean_logit_error"] >= 0.1   # fp8 moved the logits (measured 0.39)
    assert got["top1_agreement"] >= 0.90
    assert abs(got["ppl_quantized"] / got["ppl_float"] - 1) <= 0.05
