"""The Pallas decode kernel (interpret=True on CPU) against the pure-jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.kernels.kernel_cases import make_case, rel_error, tolerance

from xlaserve.kernels.paged_attention import paged_attention, paged_attention_reference

# (query heads, kv heads) -> GQA ratios 1, 3 and 8.
GQA = {1: (2, 2), 3: (6, 2), 8: (8, 1)}


def run_decode(case, **kw):
    args = (case.q[:, 0], case.k_cache, case.v_cache, case.layer, case.block_tables,
            case.kv_lens)
    out = paged_attention(*args, scale=case.scale, interpret=True, **kw)
    ref = paged_attention_reference(*args, scale=case.scale, soft_cap=kw.get("soft_cap"),
                                    sliding_window=kw.get("sliding_window"))
    return out, ref


@pytest.mark.parametrize("ratio,block_size,dtype,k_splits", [
    (1, 8, jnp.float32, 1),
    (3, 16, jnp.float32, 2),
    (8, 32, jnp.float32, 1),
    (3, 16, jnp.bfloat16, 1),
    (8, 8, jnp.bfloat16, 3),
])
def test_decode_matches_reference(ratio, block_size, dtype, k_splits):
    bs = block_size
    width = 5
    # Lengths: 1, a block multiple, not a multiple, the maximum (W * bs), and padding (0).
    kv_lens = [1, 2 * bs, bs + 3, width * bs, 0]
    heads, kv_heads = GQA[ratio]
    case = make_case(ratio * 100 + bs, q_lens=[1 if n else 0 for n in kv_lens],
                     prefixes=[max(n - 1, 0) for n in kv_lens], chunk=1, heads=heads,
                     kv_heads=kv_heads, head_dim=32, block_size=bs, dtype=dtype, width=width)
    out, ref = run_decode(case, k_splits=k_splits)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_error(out, ref) < tolerance(dtype)
    np.testing.assert_array_equal(np.asarray(out[4], np.float32), 0.0)  # padding row


def test_decode_soft_cap_and_auto_splits():
    case = make_case(7, q_lens=[1, 1, 1], prefixes=[40, 9, 63], chunk=1, heads=6, kv_heads=2,
                     head_dim=16, block_size=16, dtype=jnp.float32)
    for soft_cap in (None, 2.0):
        out, ref = run_decode(case, soft_cap=soft_cap, pages_per_block=2, k_splits=2)
        assert rel_error(out, ref) < 1e-5
    capped, uncapped = (run_decode(case, soft_cap=c, k_splits=1)[1] for c in (2.0, None))
    assert rel_error(capped, uncapped) > 1e-3  # the cap changes the answer, so it is exercised


def test_interpret_mode_poisons_unwritten_outputs():
    """The premise of `rel_error`'s NaN check: interpret mode starts outputs as NaN, so a row
    a kernel never writes cannot pass as zeros."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    out = pl.pallas_call(kernel, grid=(2,), in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
                         out_specs=pl.BlockSpec((2,), lambda i: (i,)),
                         out_shape=jax.ShapeDtypeStruct((4,), jnp.float32),
                         interpret=True)(jnp.ones(4))
    assert np.isnan(np.asarray(out[2:])).all()


def valid_inputs():
    case = make_case(3, q_lens=[1, 1], prefixes=[5, 20], chunk=1, heads=4, kv_heads=2,
                     head_dim=8, block_size=8, dtype=jnp.float32)
    return dict(q=case.q[:, 0], k_cache=case.k_cache, v_cache=case.v_cache, layer=case.layer,
                block_tables=case.block_tables, kv_lens=case.kv_lens)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: {"q": a["q"][:, :3]}, ValueError, r"query heads \(3\).*kv heads \(2\)"),
    (lambda a: {"q": a["q"][..., :4]}, ValueError, r"head_dim of q \(4\) != .* \(8\)"),
    (lambda a: {"v_cache": a["v_cache"][:, :-1]}, ValueError, "shapes differ"),
    (lambda a: {"block_tables": a["block_tables"].at[1, 0].set(999)}, ValueError,
     r"out of range \[0, \d+\); first at \[1, 0\] = 999"),
    (lambda a: {"block_tables": a["block_tables"].at[0, 1].set(-1)}, ValueError,
     r"first at \[0, 1\] = -1"),
    (lambda a: {"block_tables": a["block_tables"][:1]}, ValueError, r"\[B=2, W\]"),
    (lambda a: {"block_tables": a["block_tables"].astype(jnp.int64 if jax.config.x64_enabled
                                                          else jnp.float32)},
     TypeError, "block_tables must be int32"),
    (lambda a: {"kv_lens": a["kv_lens"][:1]}, ValueError, r"kv_lens must have shape \(2,\)"),
    (lambda a: {"kv_lens": a["kv_lens"].astype(jnp.float32)}, TypeError, "kv_lens must be int32"),
    (lambda a: {"kv_lens": a["kv_lens"].at[0].set(10_000)}, ValueError, "kv_lens must lie in"),
    (lambda a: {"q": a["q"].astype(jnp.bfloat16)}, TypeError, "q dtype bfloat16 != cache"),
    (lambda a: {"k_cache": a["k_cache"].astype(jnp.int32),
                "v_cache": a["v_cache"].astype(jnp.int32)}, TypeError, "cache dtype"),
    (lambda a: {"layer": jnp.int32(2)}, ValueError, r"layer=2 out of range \[0, 2\)"),
])
def test_decode_rejects_bad_inputs(change, error, match):
    args = valid_inputs()
    args.update(change(args))
    with pytest.raises(error, match=match):
        paged_attention(**args, scale=0.3, interpret=True)


def test_decode_gpu_shape_rules_name_the_values():
    args = valid_inputs()
    with pytest.raises(ValueError, match="pages_per_block must be a power of two, got 3"):
        paged_attention(**args, scale=0.3, pages_per_block=3)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 200])
def test_decode_sliding_window(window):
    """The newest `window` positions only: windows of one position, inside a block, exactly a
    block, across a block boundary, and wider than every row (== no window). Splits whose
    pages all lie before the window contribute nothing."""
    kv_lens = [1, 16, 40, 63, 0]
    case = make_case(window, q_lens=[1 if n else 0 for n in kv_lens],
                     prefixes=[max(n - 1, 0) for n in kv_lens], chunk=1, heads=6, kv_heads=2,
                     head_dim=16, block_size=8, dtype=jnp.float32)
    out, ref = run_decode(case, sliding_window=window, pages_per_block=1, k_splits=3)
    assert rel_error(out, ref) < 1e-5
    full = run_decode(case, k_splits=1)[1]
    differs = rel_error(ref, full) > 1e-3
    assert differs == (window < 63)  # the window hides keys of the longest row


def test_sliding_window_must_be_positive():
    case = make_case(3, q_lens=[1], prefixes=[4], chunk=1, heads=2, kv_heads=2, head_dim=8,
                     block_size=8, dtype=jnp.float32)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"sliding_window must be a positive int or None, "
                                             f"got {bad!r}"):
            run_decode(case, sliding_window=bad)
