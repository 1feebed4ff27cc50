"""Meshes, replicas, presets and the per-model rules, including the layouts that are refused."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from xlaserve.checkpoints.store import load_config
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.mesh import MeshConfig, make_mesh, make_replica_meshes
from xlaserve.sharding.parallel_forward import make_sharded_forward, microbatch_count
from xlaserve.sharding.rules import model_rules

from .scenarios import TINY, TINY_GQA

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_presets() -> None:
    assert MeshConfig.load(CONFIGS / "tp2.toml") == MeshConfig(tensor=2)
    assert MeshConfig.load(CONFIGS / "pp2.toml") == MeshConfig(pipeline=2)
    assert MeshConfig.load(CONFIGS / "tp2_pp2.toml") == MeshConfig(pipeline=2, tensor=2)
    assert MeshConfig.load(CONFIGS / "2x_tp2.toml") == MeshConfig(tensor=2, replicas=2)
    with pytest.raises(ValueError, match="unknown \\[mesh\\] keys \\['data'\\]"):
        MeshConfig.from_dict({"data": 2})
    with pytest.raises(ValueError, match="tensor must be an int >= 1, got 0"):
        MeshConfig(tensor=0)


def test_replica_meshes_split_the_devices() -> None:
    meshes = make_replica_meshes(MeshConfig(tensor=2, replicas=4))
    ids = [[d.id for d in m.devices.flat] for m in meshes]
    assert ids == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(dict(m.shape) == {"pipeline": 1, "expert": 1, "tensor": 2} for m in meshes)
    with pytest.raises(ValueError, match="3 replicas of pipeline=1 x tensor=4 need 12 devices, "
                                         "but only 8"):
        make_replica_meshes(MeshConfig(tensor=4, replicas=3))


def test_kv_heads_split_only_when_tensor_divides_them(model_dir) -> None:
    smol = load_config(model_dir)                      # 9 heads, 3 KV heads
    assert model_rules(smol, MeshConfig(tensor=3))["kv_heads"] == "tensor"
    assert model_rules(TINY_GQA, MeshConfig(tensor=2))["kv_heads"] == "tensor"
    assert model_rules(TINY_GQA, MeshConfig(tensor=4))["kv_heads"] is None   # 2 < 4
    assert model_rules(TINY.replace(num_heads=12, num_kv_heads=3), MeshConfig(tensor=2))[
        "kv_heads"] is None                                                  # 2 does not divide 3
    assert model_rules(TINY.replace(vocab_size=250), MeshConfig(tensor=4))["vocab"] is None
    layout = ShardLayout.create(TINY, MeshConfig(pipeline=2, tensor=4))
    assert layout.param_specs()["layers"]["wq"] == jax.sharding.PartitionSpec(
        "pipeline", None, "tensor", None)
    assert layout.kv_spec() == jax.sharding.PartitionSpec("pipeline", None, None, "tensor", None)


def test_tensor_not_dividing_heads_is_refused() -> None:
    mesh = make_mesh(MeshConfig(tensor=3))
    with pytest.raises(ValueError, match="tensor=3 does not divide num_heads=8"):
        make_sharded_forward(TINY, mesh)
    with pytest.raises(ValueError, match="pipeline=3 does not divide num_layers=4"):
        ShardLayout.create(TINY, MeshConfig(pipeline=3))


def test_microbatch_count() -> None:
    assert [microbatch_count(b, 4) for b in (1, 2, 3, 4, 6, 8)] == [1, 2, 3, 4, 3, 4]
