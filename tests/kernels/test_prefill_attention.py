"""The Pallas ragged chunked-prefill kernel (interpret=True on CPU) against the reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tests.kernels.kernel_cases import make_case, rel_error, tolerance

from xlaserve.kernels.prefill_attention import prefill_attention, prefill_attention_reference

GQA = {1: (2, 2), 3: (6, 2), 8: (8, 1)}


def run_prefill(case, **kw):
    args = (case.q, case.k_cache, case.v_cache, case.layer, case.block_tables, case.q_lens,
            case.kv_lens)
    out = prefill_attention(*args, scale=case.scale, interpret=True, **kw)
    ref = prefill_attention_reference(*args, scale=case.scale, soft_cap=kw.get("soft_cap"),
                                      sliding_window=kw.get("sliding_window"))
    return out, ref


def check(case, out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_error(out, ref) < tolerance(dtype)
    # Query slots t >= q_lens[b] are padding: exact zeros.
    for row, n in enumerate(np.asarray(case.q_lens)):
        np.testing.assert_array_equal(np.asarray(out[row, n:], np.float32), 0.0)


# Rows are ragged within each batch: chunk lengths from 1 to T, prefixes from 0 to several
# blocks, block-multiple and not, one row ending exactly at the table's capacity, one padding row.
@pytest.mark.parametrize("ratio,bs,dtype,chunk,q_lens,prefixes,width", [
    (1, 8, jnp.float32, 16, [1, 16, 5, 0], [0, 24, 13, 7], 5),
    (3, 16, jnp.float32, 24, [24, 17, 1], [0, 16, 45], 4),
    (8, 32, jnp.float32, 33, [33, 2, 20], [31, 64, 0], None),
    (3, 16, jnp.bfloat16, 20, [20, 9, 1], [12, 32, 70], None),
    (8, 8, jnp.bfloat16, 12, [12, 3], [36, 0], 6),
])
def test_prefill_matches_reference(ratio, bs, dtype, chunk, q_lens, prefixes, width):
    heads, kv_heads = GQA[ratio]
    case = make_case(ratio * 1000 + bs + chunk, q_lens=q_lens, prefixes=prefixes, chunk=chunk,
                     heads=heads, kv_heads=kv_heads, head_dim=32, block_size=bs, dtype=dtype,
                     width=width)
    out, ref = run_prefill(case)
    check(case, out, ref, dtype)


def test_prefill_long_chunks():
    """A 512-token chunk from position 0 beside a 300-token chunk after a 40-token prefix."""
    case = make_case(11, q_lens=[512, 300], prefixes=[0, 40], chunk=512, heads=3, kv_heads=1,
                     head_dim=16, block_size=16, dtype=jnp.float32)
    out, ref = run_prefill(case)
    check(case, out, ref, jnp.float32)


def test_prefill_small_tiles_and_soft_cap():
    """Several query tiles per row (block_q smaller than the chunk), one compute block per KV
    block, and the logits soft cap."""
    case = make_case(12, q_lens=[10, 7], prefixes=[21, 3], chunk=10, heads=6, kv_heads=2,
                     head_dim=16, block_size=8, dtype=jnp.float32)
    for soft_cap in (None, 1.5):
        out, ref = run_prefill(case, soft_cap=soft_cap, block_q=2, pages_per_block=1)
        check(case, out, ref, jnp.float32)


@pytest.mark.parametrize("window", [1, 7, 8, 30])
def test_prefill_sliding_window(window):
    """Chunks after a prefix and from position 0, several query tiles: every query sees the
    last `window` positions up to itself, across chunk and block boundaries."""
    case = make_case(20 + window, q_lens=[12, 5, 12], prefixes=[21, 3, 0], chunk=12, heads=6,
                     kv_heads=2, head_dim=16, block_size=8, dtype=jnp.float32)
    out, ref = run_prefill(case, sliding_window=window, block_q=4, pages_per_block=1)
    check(case, out, ref, jnp.float32)
    assert rel_error(ref, run_prefill(case)[1]) > 1e-3  # the window hides keys


def valid_inputs():
    case = make_case(4, q_lens=[4, 2], prefixes=[3, 0], chunk=4, heads=4, kv_heads=2,
                     head_dim=8, block_size=8, dtype=jnp.float32)
    return dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, layer=case.layer,
                block_tables=case.block_tables, q_lens=case.q_lens, kv_lens=case.kv_lens)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: {"q": a["q"][:, 0]}, ValueError, r"q must be \[B, T, H, D\], got shape"),
    (lambda a: {"q_lens": a["q_lens"].at[0].set(5)}, ValueError,
     r"q_lens must lie in \[0, T = 4\], got \[5, 2\]"),
    (lambda a: {"q_lens": a["q_lens"].at[1].set(3)}, ValueError,
     r"q_lens must not exceed kv_lens.*q_lens=\[4, 3\] kv_lens=\[7, 2\]"),
    (lambda a: {"q_lens": a["q_lens"].astype(jnp.float32)}, TypeError, "q_lens must be int32"),
    (lambda a: {"block_tables": a["block_tables"].at[0, 0].set(77)}, ValueError,
     r"first at \[0, 0\] = 77"),
    (lambda a: {"k_cache": a["k_cache"][0]}, ValueError, r"k_cache must be \[L, N, bs, KVH, D\]"),
])
def test_prefill_rejects_bad_inputs(change, error, match):
    args = valid_inputs()
    args.update(change(args))
    with pytest.raises(error, match=match):
        prefill_attention(**args, scale=0.3, interpret=True)


def test_prefill_rejects_bad_tile():
    with pytest.raises(ValueError, match="block_q a power of two, got 1, 3"):
        prefill_attention(**valid_inputs(), scale=0.3, interpret=True, pages_per_block=1,
                          block_q=3)


def test_soft_cap_must_be_positive():
    """A cap of 0 would divide by zero (NaN logits): refused by both Pallas kernels."""
    from xlaserve.kernels.paged_attention import paged_attention

    case = make_case(5, q_lens=[2], prefixes=[3], chunk=2, heads=2, kv_heads=2, head_dim=8,
                     block_size=8, dtype=jnp.float32)
    args = (case.k_cache, case.v_cache, case.layer, case.block_tables)
    for bad in (0.0, -1.0, True):
        with pytest.raises(ValueError, match=f"soft_cap must be a positive number or None, "
                                             f"got {bad!r}"):
            prefill_attention(case.q, *args, case.q_lens, case.kv_lens, scale=1.0,
                              soft_cap=bad, interpret=True)
        with pytest.raises(ValueError, match="soft_cap must be a positive number"):
            paged_attention(case.q[:, 0], *args, case.kv_lens, scale=1.0, soft_cap=bad,
                            interpret=True)
