"""The compiled one-device step on the CPU kernels: the weight matmuls and the attention are the
native kernels, each reading the stacked weights and the flat cache in place — no copy of a
layer's weight slice, of the KV cache, or of the flat cache the layer loop carries."""

from __future__ import annotations

import re

import numpy as np
import pytest

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import init_params, param_shapes
from xlaserve.serving.runner.buckets import BucketPlan
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.sharding.mesh import make_mesh

# Every layer weight (the smallest: wk, 128 x 2 x 32 = 8192 floats) is bigger than any
# activation of the buckets below (32 tokens x 128 = 4096 floats).
CONFIG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=False)
NUM_BLOCKS, BLOCK_SIZE = 40, 16


@pytest.fixture(scope="module")
def hlo_by_bucket() -> dict[tuple[int, int, int], str]:
    runner = ModelRunner(init_params(CONFIG), CONFIG, make_mesh(), num_blocks=NUM_BLOCKS,
                         block_size=BLOCK_SIZE, max_num_seqs=4,
                         buckets=BucketPlan(row_sizes=(4,), token_sizes=(32,),
                                            table_widths=(4, 8)))
    assert runner.backend == "cpu"
    assert runner.buckets.table_widths == (8,)   # the kernels read real blocks: one width
    runner.warmup()
    return {shape: exe.as_text() for shape, exe in runner._compiled.items()}


def test_the_step_calls_the_native_kernels(hlo_by_bucket) -> None:
    for shape, hlo in hlo_by_bucket.items():
        targets = re.findall(r'custom_call_target="(\w+)"', hlo)
        assert targets.count("xlaserve_cpu_paged_attention") == 1, shape   # inside the layer loop
        # RoPE and the KV write in one call, the cache updated through its aliased outputs
        assert targets.count("xlaserve_cpu_rope_kv_write") == 1, shape
        # qkv and gate+up on packed weight panels with their pre-norms folded in, the output
        # head on packed panels; o adding the residual; down with its silu gate folded in,
        # adding the residual too
        assert targets.count("xlaserve_cpu_matmul_packed_normed") == 2, shape
        assert targets.count("xlaserve_cpu_matmul_packed") == 1, shape
        assert targets.count("xlaserve_cpu_matmul_packed_add") == 1, shape
        assert targets.count("xlaserve_cpu_matmul_packed_gated") == 1, shape


def test_no_weight_slice_or_cache_is_copied(hlo_by_bucket) -> None:
    """No copy or slice in the step is as big as a layer's smallest weight matrix: weight
    slices are not materialised, nor is any part of the cache."""
    smallest = min(int(np.prod(s[1:])) for s in param_shapes(CONFIG)["layers"].values()
                   if len(s) > 2)
    for shape, hlo in hlo_by_bucket.items():
        for dims, op in re.findall(r"= f32\[([\d,]*)\]\S* (copy|dynamic-slice|slice)\(", hlo):
            numel = int(np.prod([int(d) for d in dims.split(",") if d]))
            assert numel < smallest, f"bucket {shape}: {op} of f32[{dims}]"
        assert "input_output_alias" in hlo   # the donated cache is updated in place
        # no scatter or dynamic-update-slice into the cache is left beside the kernel
        assert not re.search(r"(scatter|dynamic-update-slice)\(", hlo), shape
