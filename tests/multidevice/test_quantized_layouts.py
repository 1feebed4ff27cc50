"""int8 weights on a mesh: a quantized checkpoint restores straight into tp2 / tp4 (each scale
on the shard of the weights it scales), and a float checkpoint quantized as it loads on the
mesh is the same model; the sharded forward gives the one-device logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from xlaserve.checkpoints.store import load_config, load_params, save_params
from xlaserve.models.llama import init_kv_cache
from xlaserve.models.quantize import quantize_params
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.memory import shard_shape
from xlaserve.sharding.mesh import MeshConfig, make_mesh
from xlaserve.sharding.parallel_forward import make_sharded_forward

from .scenarios import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    TINY,
    decode_after_prefill,
    ragged_prefill,
    reference,
    run,
    tiny_params,
)

# head_dim 32: wo's groups of 32 run along head_dim, so a head's scales shard with the head.
FLOAT = TINY.replace(head_dim=32)
INT8 = FLOAT.replace(quantization="int8")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("int8")
    host = tiny_params(FLOAT, seed=7)
    out = {}
    for name, config, params in (("float", FLOAT, host), ("int8", INT8, quantize_params(host))):
        (root / name).mkdir()
        save_params(root / name, params)
        config.save(root / name / "config.json")
        out[name] = root / name
    return out


@pytest.mark.parametrize("tensor", [2, 4], ids=["tp2", "tp4"])
@pytest.mark.parametrize("source", ["int8", "float"])
def test_sharded_int8_equals_one_device(folders, tensor: int, source: str) -> None:
    one = load_params(folders["int8"], INT8, make_mesh())
    mesh = make_mesh(MeshConfig(tensor=tensor))
    layout = ShardLayout.create(INT8, mesh)
    config = load_config(folders[source], quantization="int8")
    sharded = load_params(folders[source], config, mesh)
    specs = jax.tree_util.tree_leaves(
        layout.param_specs(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, got), spec in zip(jax.tree_util.tree_leaves_with_path(sharded), specs):
        name = jax.tree_util.keystr(path)
        for shard in got.addressable_shards:   # each device holds its slice only
            assert shard.data.shape == shard_shape(got.shape, spec, {"pipeline": 1,
                                                                     "tensor": tensor}), name
    w_down = sharded["layers"]["w_down"]["scale"]   # [L, F / 32, E]: F split over tensor
    assert w_down.addressable_shards[0].data.shape[1] == w_down.shape[1] // tensor

    steps = [ragged_prefill(INT8.vocab_size), decode_after_prefill(INT8.vocab_size)]
    expected = reference(jax.device_get(one), INT8, steps,
                         init_kv_cache(INT8, NUM_BLOCKS, BLOCK_SIZE))
    fwd = make_sharded_forward(INT8, mesh)
    kv = layout.init_kv_cache(mesh, NUM_BLOCKS, BLOCK_SIZE)
    for step, (want, _) in zip(steps, expected):
        logits, kv = run(fwd, sharded, INT8, step, kv)
        # A float folder quantized on the mesh may round a tie one step apart: same model
        # within int8's resolution, not bit for bit.
        tol = 1e-5 if source == "int8" else 2e-2 * float(np.abs(want).max())
        np.testing.assert_allclose(logits, want, rtol=0, atol=tol)
