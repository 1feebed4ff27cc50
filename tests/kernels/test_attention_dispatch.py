"""Backend dispatch, the jax-triton kernel (GPU only) and the Pallas kernels' GPU lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from tests.kernels.kernel_cases import make_case, rel_error

from xlaserve.kernels.attention import paged_attention, resolve_backend
from xlaserve.kernels.paged_attention import paged_attention as pallas_decode
from xlaserve.kernels.paged_attention import paged_attention_reference
from xlaserve.kernels.prefill_attention import prefill_attention

ON_GPU = jax.default_backend() == "gpu"


def test_auto_picks_reference_on_cpu_and_pallas_on_gpu():
    assert resolve_backend("auto", "cpu") == "reference"
    assert resolve_backend("auto", "gpu") == "pallas"
    assert resolve_backend("pallas", "cpu") == "pallas"


@pytest.mark.parametrize("backend,platform,match", [
    ("triton", "cpu", "'triton' is not available on platform 'cpu': jax-triton needs a GPU"),
    ("pallas", "tpu", "'pallas' is not available on platform 'tpu'"),
    ("cuda", "cpu", "attention_backend must be one of"),
])
def test_unavailable_backends_name_the_platform(backend, platform, match):
    with pytest.raises(ValueError, match=match):
        resolve_backend(backend, platform)


@pytest.mark.parametrize("chunk", [1, 6])
def test_dispatch_pallas_matches_reference(chunk):
    q_lens = [chunk, 0] if chunk == 1 else [6, 2]
    case = make_case(5 + chunk, q_lens=q_lens, prefixes=[9, 17], chunk=chunk, heads=6,
                     kv_heads=2, head_dim=16, block_size=8, dtype=jnp.float32)
    args = (case.q, case.k_cache, case.v_cache, case.layer, case.block_tables, case.q_lens,
            case.kv_lens)
    out = paged_attention(*args, scale=case.scale, backend="pallas")
    ref = paged_attention(*args, scale=case.scale, backend="reference")
    assert out.shape == case.q.shape
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
