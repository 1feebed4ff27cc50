"""GGUF Q8_0 tensors land in xlaserve's int8 format exactly: a Q8_0 block is 32 weights along
the row (the matmul's contraction axis, GGUF's ne0) with d = max |w| / 127 stored as float16,
which is what `quantize_int8` computes for a group of 32 along K.  So the converter's float
step (dequantize, then quantize with --quantize int8) gives back Q8_0's own q and d."""

from __future__ import annotations

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
