"""Backend dispatch, the jax-triton kernel (GPU only) and the Pallas kernels' GPU lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from tests.kernels.kernel_cases import make_case, rel_error, to_flat

from xlaserve.kernels.attention import attention, resolve_backend
from xlaserve.kernels.cpu import build
from xlaserve.kernels.paged_attention import paged_attention as pallas_decode
from xlaserve.kernels.paged_attention import paged_attention_reference
from xlaserve.kernels.prefill_attention import prefill_attention

ON_GPU = jax.default_backend() == "gpu"


def test_auto_picks_the_cpu_kernels_on_cpu_and_pallas_on_gpu():
    assert build.load() is not None, build.load_error()
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("auto", "gpu") == "pallas"
    assert resolve_backend("pallas", "cpu") == "pallas"
    assert resolve_backend("reference", "gpu") == "reference"


def test_auto_falls_back_to_reference_when_the_cpu_kernels_cannot_build(monkeypatch):
    monkeypatch.setattr(build, "load", lambda: None)
    monkeypatch.setattr(build, "load_error", lambda: "no C++ compiler found")
    assert resolve_backend("auto", "cpu") == "reference"
    with pytest.raises(ValueError, match="did not build \\(no C\\+\\+ compiler found\\)"):
        resolve_backend("cpu", "cpu")


@pytest.mark.parametrize("backend,platform,match", [
    ("triton", "cpu", "'triton' is not available on platform 'cpu': jax-triton needs a GPU"),
    ("cpu", "gpu", "'cpu' runs on the CPU platform, not 'gpu'"),
    ("pallas", "tpu", "'pallas' is not available on platform 'tpu'"),
    ("cuda", "cpu", "attention_backend must be one of"),
])
def test_unavailable_backends_name_the_platform(backend, platform, match):
    with pytest.raises(ValueError, match=match):
        resolve_backend(backend, platform)


@pytest.mark.parametrize("backend", ["pallas", "cpu"])
@pytest.mark.parametrize("q_lens,padding", [([1, 1], 0), ([1, 0], 1), ([6, 2], 2), ([1, 3], 0),
                                            ([40, 1, 17], 5)])
def test_dispatch_matches_reference(backend, q_lens, padding):
    """One token per row (the Pallas decode kernel), with a padding row; prompt chunks (cut
    into pieces of at most PIECE tokens for the Pallas prefill kernel, 40 -> 16 + 16 + 8) and
    padding tokens."""
    case = make_case(5 + sum(q_lens), q_lens=q_lens, prefixes=[9, 17, 30][:len(q_lens)],
                     chunk=max(q_lens),
                     heads=6, kv_heads=2, head_dim=16, block_size=8, dtype=jnp.float32)
    flat, _ = to_flat(case, padding)
    out = attention(*flat.args(), **flat.kw(), backend=backend)
    ref = attention(*flat.args(), **flat.kw(), backend="reference")
    assert out.shape == flat.q.shape
    assert rel_error(out, ref) < 1e-5


def test_pallas_handles_a_flat_batch_as_wide_as_its_rows_but_not_one_per_row():
    """T == R, but row 0 holds both tokens: the decode shortcut must not be taken."""
    case = make_case(3, q_lens=[2, 0], prefixes=[5, 0], chunk=2, heads=6, kv_heads=2,
                     head_dim=16, block_size=8, dtype=jnp.float32)
    flat, _ = to_flat(case, 0)
    assert flat.q.shape[0] == flat.block_tables.shape[0] == 2
    out = attention(*flat.args(), **flat.kw(), backend="pallas")
    ref = attention(*flat.args(), **flat.kw(), backend="reference")
    assert rel_error(out, ref) < 1e-5


@pytest.mark.skipif(not ON_GPU, reason="jax-triton needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_decode_matches_reference(dtype):
    from xlaserve.kernels.triton.paged_attention import paged_attention as triton_decode

    case = make_case(9, q_lens=[1, 1, 1, 0], prefixes=[0, 47, 300, 0], chunk=1, heads=9,
                     kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    args = (case.q[:, 0], case.k_cache, case.v_cache, case.layer, case.block_tables,
            case.kv_lens)
    ref = paged_attention_reference(*args, scale=case.scale)
    for k_splits in (1, 3):
        out = triton_decode(*args, scale=case.scale, k_splits=k_splits)
        assert rel_error(out, ref) < (1e-5 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernels_lower_through_triton(dtype):
    """Cross-lowering for CUDA runs the Pallas -> Triton IR lowering on CPU: it rejects what a
    GPU build would (non power-of-two loads, primitives Triton lacks) without a GPU."""
    s = jax.ShapeDtypeStruct
    cache = s((2, 20, 16, 3, 64), dtype)
    i32 = lambda *shape: s(shape, jnp.int32)  # noqa: E731

    def decode(q, k, v, layer, tables, lens):
        return pallas_decode(q, k, v, layer, tables, lens, scale=0.125, soft_cap=30.0)

    def prefill(q, k, v, layer, tables, q_lens, kv_lens):
        return prefill_attention(q, k, v, layer, tables, q_lens, kv_lens, scale=0.125)

    lowered = [
        jax.jit(decode).trace(s((4, 9, 64), dtype), cache, cache, i32(), i32(4, 7), i32(4)),
        jax.jit(prefill).trace(s((2, 100, 9, 64), dtype), cache, cache, i32(), i32(2, 7),
                               i32(2), i32(2)),
    ]
    for traced in lowered:
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text
