"""Mesh presets, `[distributed]` tables and hand-built meshes that cannot work are refused with
an error naming the file, key and value, on one device (no forced host devices needed)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from xlaserve.models.config import ModelConfig
from xlaserve.sharding.distributed import DistributedConfig
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.mesh import MeshConfig, make_mesh

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                   num_heads=2, num_kv_heads=2, head_dim=8)


def test_mesh_presets_load() -> None:
    assert MeshConfig.load(CONFIGS / "tp2.toml") == MeshConfig(tensor=2)
    assert MeshConfig.load(CONFIGS / "tp2_pp2.toml") == MeshConfig(pipeline=2, tensor=2)


@pytest.mark.parametrize("text,match", [
    ("pipeline = 2\ntensor = 2\n",
     r"expected a \[mesh\] table, found top-level keys \['pipeline', 'tensor'\]"),
    ("[mesh_]\ntensor = 4\n", r"expected a \[mesh\] table, found top-level keys \['mesh_'\]"),
    ("mesh = 4\n", r"expected a \[mesh\] table, found top-level keys \['mesh'\]"),
    ("[mesh]\ntensors = 4\n", r"unknown \[mesh\] keys \['tensors'\]"),
    ("[mesh]\ntensor = \"4\"\n", r"MeshConfig.tensor must be an int >= 1, got '4'"),
])
def test_mesh_preset_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "preset.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"preset\.toml: .*{match}"):
        MeshConfig.load(path)


def test_server_config_is_not_a_mesh_preset() -> None:
    with pytest.raises(ValueError, match=r"smollm2\.toml: not a mesh preset.*'models'"):
        MeshConfig.load(CONFIGS / "smollm2.toml")


BASE = {"coordinator": "10.0.0.1:9876", "num_processes": 2, "process_id": 0}


@pytest.mark.parametrize("change,match", [
    ({"heartbeat_timeout_s": "10"}, "heartbeat_timeout_s='10': expected int, got str"),
    ({"heartbeat_timeout_s": 2.5}, "heartbeat_timeout_s=2.5: expected int, got float"),
    ({"coordinator": 9876}, "coordinator_address=9876: expected str, got int"),
    ({"num_processes": True}, "num_processes=True: expected int, got bool"),
    ({"initialization_timeout_s": None}, "initialization_timeout_s=None: expected int"),
    ({"cpu_collectives": 1}, "cpu_collectives=1: expected str"),
])
def test_distributed_types(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=r"^\[distributed\] " + match.replace(".", r"\.")):
        DistributedConfig.resolve({**BASE, **change}, env={})


def test_distributed_accepts_a_good_table() -> None:
    c = DistributedConfig.resolve({**BASE, "heartbeat_timeout_s": 30}, env={})
    assert c is not None
    assert (c.coordinator_address, c.num_processes, c.process_id, c.heartbeat_timeout_s) == \
        ("10.0.0.1:9876", 2, 0, 30)


def test_mesh_without_a_model_axis() -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("tensor",))
    with pytest.raises(ValueError, match=r"axes \('tensor',\) lacks the axis 'pipeline'"):
        ShardLayout.create(TINY, mesh)
    layout = ShardLayout.create(TINY, MeshConfig())
    with pytest.raises(ValueError, match=r"lacks the axis 'pipeline'"):
        layout.param_shardings(mesh)
    bare = Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match=r"lacks the axis 'pipeline' and 'tensor'"):
        layout.kv_sharding(bare)
    shardings = layout.param_shardings(make_mesh())  # the mesh make_mesh builds is fine
    assert jax.tree_util.tree_leaves(shardings)
