"""The decode floor counts the bytes a batch-1 step reads."""

from __future__ import annotations

import numpy as np

from xlaserve.bench.roofline import decode_read_bytes, param_bytes


def test_untied_input_embedding_is_read_one_row_per_step() -> None:
    layers = {"w": np.zeros((2, 8, 8), np.float32)}                 # 512 bytes
    tied = {"embed": np.zeros((100, 8), np.float32), "layers": layers}
    untied = {**tied, "lm_head": np.zeros((8, 100), np.float32)}
    assert decode_read_bytes(tied) == param_bytes(tied) == 3200 + 512
    assert param_bytes(untied) == 2 * 3200 + 512
    assert decode_read_bytes(untied) == 3200 + 512 + 8 * 4          # lm_head + one embed row
    # The CPU kernels' packed head (a transposed copy of a tied table): the table itself is
    # then only looked up, one row per step.
    packed = {**tied, "head": np.zeros((1, 1, 8, 100), np.float32)}
    assert decode_read_bytes(packed) == 3200 + 512 + 8 * 4
