"""A checkpoint saved from one mesh restores straight into another mesh's layout."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from xlaserve.checkpoints.store import load_params, save_params
from xlaserve.models.llama import param_shapes
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.memory import shard_shape
from xlaserve.sharding.mesh import MeshConfig, make_mesh

from .scenarios import TINY, tiny_params


@pytest.mark.parametrize("source,target", [((1, 2), (1, 4)), ((2, 1), (1, 2)),
                                           ((2, 2), (4, 1))],
                         ids=["tp2->tp4", "pp2->tp2", "tp2xpp2->pp4"])
def test_restore_into_another_mesh(tmp_path, source, target) -> None:
    host = tiny_params(TINY, seed=5)
    src_mesh = make_mesh(MeshConfig(*source))
    placed = ShardLayout.create(TINY, src_mesh).shard_params(host, src_mesh)
    save_params(tmp_path, placed)   # each device writes its own shards

    mesh = make_mesh(MeshConfig(*target))
    layout = ShardLayout.create(TINY, mesh)
    restored = load_params(tmp_path, TINY, mesh)
    sizes = {"pipeline": target[0], "tensor": target[1]}
    flat_host = jax.tree_util.tree_leaves_with_path(host)
    flat_restored = jax.tree_util.tree_leaves(restored)
    flat_shardings = jax.tree_util.tree_leaves(layout.param_shardings(mesh))
    flat_specs = jax.tree_util.tree_leaves(
        layout.param_specs(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert len(flat_host) == len(flat_restored) == len(jax.tree_util.tree_leaves(
        param_shapes(TINY), is_leaf=lambda x: isinstance(x, tuple)))
    for (path, want), got, sharding, spec in zip(flat_host, flat_restored, flat_shardings,
                                                 flat_specs):
        name = jax.tree_util.keystr(path)
        assert got.sharding.is_equivalent_to(sharding, got.ndim), name
        # Every device holds only its slice, as restored (not a full copy cut down later).
        for shard in got.addressable_shards:
            assert shard.data.shape == shard_shape(want.shape, spec, sizes), name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
