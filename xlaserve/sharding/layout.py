"""One model on one mesh: which slice of every parameter and of the KV cache each device holds.

    ShardLayout.create(model, MeshConfig(pipeline=2, tensor=2))   (or expert=2 for a MoE model)
      .rules              logical axis -> mesh axis, specialised to the model (rules.model_rules)
      .param_specs()      PartitionSpec per parameter (same pytree as models.llama.param_axes)
      .kv_spec()          PartitionSpec of each KV array [layers, blocks, block_size, K, D]
      .param_shardings(mesh), .kv_sharding(mesh)   the same, as NamedShardings on a real mesh

The layout is pure bookkeeping over shapes: checkpoints restore into it (checkpoints/store.py),
the sharded forward reads it to build its shard_map (parallel_forward.py), and memory.py prices
it per device.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import KV_AXES, KVCache, Params, kv_shape, param_axes, param_shapes
from xlaserve.models.quantize import leaf_dtype
from xlaserve.sharding.mesh import EXPERT_AXIS, MESH_AXES, MeshConfig
from xlaserve.sharding.rules import model_rules, partition_spec


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple)


def _require_model_axes(mesh: Mesh, model: ModelConfig) -> None:
    """The specs name both mesh axes (and a MoE model's the expert axis), so a mesh must have
    them, even at size one."""
    needed = MESH_AXES + ((EXPERT_AXIS,) if model.is_moe else ())
    missing = [a for a in needed if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"mesh with axes {tuple(mesh.axis_names)} lacks the axis "
                         f"{' and '.join(repr(a) for a in missing)}: a model mesh needs the axes "
                         f"{needed} (size 1 where unused; build it with sharding.mesh.make_mesh)")


@dataclass(frozen=True)
class ShardLayout:
    model: ModelConfig
    mesh: MeshConfig
    rules: Mapping[str, str | None]

    @classmethod
    def create(cls, model: ModelConfig, mesh: MeshConfig | Mesh) -> ShardLayout:
        """Validate the model against the mesh (ValueError with the numbers) and derive rules."""
        if isinstance(mesh, Mesh):
            _require_model_axes(mesh, model)
            mesh = MeshConfig.of(mesh)
        mesh = replace(mesh, replicas=1)   # one replica's layout
        return cls(model, mesh, model_rules(model, mesh))

    # -- what each shard holds -------------------------------------------------------------------

    @property
    def kv_heads_split(self) -> bool:
        return self.rules["kv_heads"] == "tensor" and self.mesh.tensor > 1

    @property
    def vocab_split(self) -> bool:
        return self.rules["vocab"] == "tensor" and self.mesh.tensor > 1

    @property
    def heads_per_shard(self) -> int:
        return self.model.num_heads // self.mesh.tensor

    @property
    def kv_heads_per_shard(self) -> int:
        k = self.model.num_kv_heads
        return k // self.mesh.tensor if self.kv_heads_split else k

    @property
    def experts_split(self) -> bool:
        return self.model.is_moe and self.mesh.expert > 1

    @property
    def experts_per_shard(self) -> int:
        return self.model.num_experts // self.mesh.expert

    # -- PartitionSpecs and shardings ------------------------------------------------------------

    def spec(self, axes: tuple[str | None, ...]) -> PartitionSpec:
        return partition_spec(axes, self.rules)

    def param_specs(self) -> Params:
        return jax.tree_util.tree_map(self.spec, param_axes(self.model), is_leaf=_is_axes)

    def kv_spec(self) -> PartitionSpec:
        return self.spec(KV_AXES)

    def _check(self, mesh: Mesh) -> None:
        _require_model_axes(mesh, self.model)
        if MeshConfig.of(mesh) != self.mesh:
            raise ValueError(f"layout is for {self.mesh.describe()}, but the mesh is "
                             f"{dict(mesh.shape)}")

    def param_shardings(self, mesh: Mesh) -> Params:
        self._check(mesh)
        return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), self.param_specs(),
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))

    def kv_sharding(self, mesh: Mesh) -> NamedSharding:
        self._check(mesh)
        return NamedSharding(mesh, self.kv_spec())

    def param_targets(self, mesh: Mesh) -> Params:
        """ShapeDtypeStructs carrying shardings: what orbax restores into."""
        dtype = self.model.dtype
        return jax.tree_util.tree_map_with_path(
            lambda path, shape, sharding: jax.ShapeDtypeStruct(
                shape, jnp.dtype(leaf_dtype(path, dtype, self.model.quantization)),
                sharding=sharding),
            param_shapes(self.model), self.param_shardings(mesh), is_leaf=_is_axes)

    # -- placing arrays --------------------------------------------------------------------------

    def shard_params(self, params: Params, mesh: Mesh) -> Params:
        """Place a host (or differently placed) parameter pytree onto `mesh`.

        For random test models; real checkpoints restore straight into the shardings
        (checkpoints.store.load_params) without a full host copy."""
        def place(x: Any, sharding: NamedSharding) -> jax.Array:
            if isinstance(x, jax.Array) or sharding.is_fully_addressable:
                return jax.device_put(x, sharding)   # a no-op where it already lives there
            host = np.asarray(x)   # a mesh over several processes: each writes its devices
            return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

        return jax.tree_util.tree_map(place, params, self.param_shardings(mesh))

    def init_kv_cache(self, mesh: Mesh, num_blocks: int, block_size: int,
                      dtype: str | None = None) -> KVCache:
        """A zero KV cache [L, N, bs, K, D] created in place on every device of `mesh` (no
        host copy), by a program compiled once per shape (a runner resets its cache with it)."""
        c = self.model
        shape = kv_shape(c, num_blocks, block_size, dtype)
        zeros = _zeros(shape, jnp.dtype(dtype or c.dtype).name, self.kv_sharding(mesh))
        return KVCache(zeros(), zeros())


@functools.lru_cache(maxsize=16)
def _zeros(shape: tuple[int, ...], dtype: str, sharding: NamedSharding) -> Any:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
