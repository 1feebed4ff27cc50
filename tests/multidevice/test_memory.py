"""Per-device bytes of a layout: priced from shapes, checked against placed arrays."""

from __future__ import annotations

import jax
import pytest

from xlaserve.models.llama import init_kv_cache
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.memory import device_bytes
from xlaserve.sharding.mesh import MeshConfig, make_mesh

from .scenarios import BLOCK_SIZE, NUM_BLOCKS, TINY, TINY_GQA, tiny_params

F32 = 4


def bytes_on_device0(tree) -> int:
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == jax.devices()[0]:
                total += shard.data.nbytes
    return total


@pytest.mark.parametrize("tensor", [2, 4])
def test_tensor_parallel_holds_one_over_tp_of_sharded_weights(tensor: int) -> None:
    c = TINY
    L, E, H, K, D, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
                           c.head_dim, c.intermediate_size, c.vocab_size)
    sharded = L * (E * H * D * 2 + E * K * D * 2 + 3 * E * F) + 2 * V * E  # attn, mlp, vocab
    replicated = L * 2 * E + E                                             # the norms
    assert (sharded + replicated) * F32 == c.num_params * F32

    mesh = make_mesh(MeshConfig(tensor=tensor))
    layout = ShardLayout.create(c, mesh)
    report = device_bytes(layout, NUM_BLOCKS, BLOCK_SIZE)
    assert report.params == (sharded // tensor + replicated) * F32
    assert report.params_total == c.num_params * F32
    assert report.kv == report.kv_total // tensor
    # The same numbers as the arrays actually placed on a device.
    params = layout.shard_params(tiny_params(c), mesh)
    assert bytes_on_device0(params) == report.params
    assert bytes_on_device0(layout.init_kv_cache(mesh, NUM_BLOCKS, BLOCK_SIZE)) == report.kv
    print(f"tp{tensor}: {report.describe()}")


def test_pipeline_and_replicated_kv() -> None:
    pp2 = device_bytes(ShardLayout.create(TINY, MeshConfig(pipeline=2)), NUM_BLOCKS, BLOCK_SIZE)
    embed_and_head = 2 * TINY.vocab_size * TINY.hidden_size + TINY.hidden_size
    layers = (TINY.num_params - embed_and_head) * F32
    assert pp2.params == pp2.params_total - layers // 2   # half the layers; embeddings in full
    assert pp2.kv == pp2.kv_total // 2
    # 2 KV heads at tensor=4 are replicated: every device holds the whole KV cache of its layers.
    gqa = ShardLayout.create(TINY_GQA, MeshConfig(tensor=4))
    report = device_bytes(gqa, NUM_BLOCKS, BLOCK_SIZE)
    kv = init_kv_cache(TINY_GQA, NUM_BLOCKS, BLOCK_SIZE)
    assert report.kv == report.kv_total == kv.k.nbytes + kv.v.nbytes
