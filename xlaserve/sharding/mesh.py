"""Device meshes: `pipeline x expert x tensor` from a small config, and `replicas` such meshes
side by side (`expert` only splits a mixture-of-experts model's experts; size 1 otherwise).

    jax.devices() = [d0 d1 d2 d3 d4 d5 d6 d7],  MeshConfig(pipeline=2, tensor=2, replicas=2)

    replica 0:            tensor ->          replica 1:            tensor ->
      pipeline  stage 0 [ d0 d1 ]              pipeline  stage 0 [ d4 d5 ]
                stage 1 [ d2 d3 ]                        stage 1 [ d6 d7 ]

Replicas share nothing: each is its own Mesh holding its own copy of the parameters and its own
KV cache, and serves its own requests.  One device is the default mesh, not a special case.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# The axes every model mesh has (size 1 where unused); a MoE model's also needs EXPERT_AXIS.
MESH_AXES = ("pipeline", "tensor")
EXPERT_AXIS = "expert"


@dataclass(frozen=True)
class MeshConfig:
    pipeline: int = 1   # stages: contiguous slices of layers, activations passed stage to stage
    tensor: int = 1     # Megatron tensor parallelism: heads, mlp hidden and vocab split
    replicas: int = 1   # independent copies of the `pipeline x expert x tensor` mesh
    expert: int = 1     # expert parallelism: a MoE model's experts split (attention replicated)

    def __post_init__(self) -> None:
        for name in ("pipeline", "tensor", "replicas", "expert"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MeshConfig.{name} must be an int >= 1, got {value!r}")

    @property
    def size(self) -> int:
        """Devices in one replica's mesh."""
        return self.pipeline * self.expert * self.tensor

    @property
    def total_devices(self) -> int:
        return self.size * self.replicas

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MeshConfig":
        unknown = set(d) - {"pipeline", "tensor", "replicas", "expert"}
        if unknown:
            raise ValueError(f"unknown [mesh] keys {sorted(unknown)}; "
                             f"known: pipeline, tensor, expert, replicas")
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> "MeshConfig":
        """The `[mesh]` table of a TOML preset (configs/*.toml); missing keys take defaults.

        A file without a `[mesh]` table (a forgotten header, a misspelt table, a server config
        passed by mistake) is an error, not a one-device mesh."""
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        table = doc.get("mesh")
        if not isinstance(table, dict):
            raise ValueError(  # noqa: TRY004 - a config error, reported as one
                f"{path}: not a mesh preset: expected a [mesh] table, found "
                f"top-level keys {sorted(doc)}")
        try:
            return cls.from_dict(table)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    @classmethod
    def of(cls, mesh: Mesh) -> "MeshConfig":
        """The config of one replica's mesh (axes missing from `mesh` count as size one)."""
        shape = dict(mesh.shape)
        return cls(pipeline=int(shape.get("pipeline", 1)), tensor=int(shape.get("tensor", 1)),
                   expert=int(shape.get(EXPERT_AXIS, 1)))

    def describe(self) -> str:
        """`pipeline=P x tensor=T`, with `x expert=X` where experts are split."""
        ep = f" x expert={self.expert}" if self.expert > 1 else ""
        return f"pipeline={self.pipeline}{ep} x tensor={self.tensor}"


def make_mesh(config: MeshConfig = MeshConfig(),
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `pipeline x expert x tensor` mesh over the first `config.size` devices (or
    `devices`), tensor innermost (neighbouring devices share a layer's matmuls).

    Axes are `AxisType.Auto`, so code outside our shard_map (the sampler, the runner's glue)
    lets the compiler propagate shardings; the model step itself is placed by hand."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < config.size:
        raise ValueError(f"mesh {config.describe()} needs "
                         f"{config.size} devices, but only {len(devices)} are available")
    grid = np.array(devices[: config.size]).reshape(config.pipeline, config.expert, config.tensor)
    return Mesh(grid, ("pipeline", EXPERT_AXIS, "tensor"), axis_types=(AxisType.Auto,) * 3)


def make_replica_meshes(config: MeshConfig,
                        devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
    """`config.replicas` disjoint meshes, replica r on devices [r*size, (r+1)*size)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < config.total_devices:
        raise ValueError(
            f"{config.replicas} replicas of {config.describe()} "
            f"need {config.total_devices} devices, but only {len(devices)} are available")
    size = config.size
    return [make_mesh(config, devices[r * size:(r + 1) * size]) for r in range(config.replicas)]
