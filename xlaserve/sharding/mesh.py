"""Device meshes: `pipeline x tensor` from a small config, and `replicas` such meshes side by side.

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

MESH_AXES = ("pipeline", "tensor")


@dataclass(frozen=True)
class MeshConfig:
    pipeline: int = 1   # stages: contiguous slices of layers, activations passed stage to stage
    tensor: int = 1     # Megatron tensor parallelism: heads, mlp hidden and vocab split
    replicas: int = 1   # independent copies of the `pipeline x tensor` mesh

    def __post_init__(self) -> None:
        for name in ("pipeline", "tensor", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MeshConfig.{name} must be an int >= 1, got {value!r}")

    @property
    def size(self) -> int:
        """Devices in one replica's mesh."""
        return self.pipeline * self.tensor

    @property
    def total_devices(self) -> int:
        return self.size * self.replicas

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MeshConfig":
        unknown = set(d) - {"pipeline", "tensor", "replicas"}
        if unknown:
            raise ValueError(f"unknown [mesh] keys {sorted(unknown)}; "
                             f"known: pipeline, tensor, replicas")
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
        return cls(pipeline=int(shape.get("pipeline", 1)), tensor=int(shape.get("tensor", 1)))


def make_mesh(config: MeshConfig = MeshConfig(),
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `pipeline x tensor` mesh over the first `config.size` devices (or `devices`).

    Axes are `AxisType.Auto`, so code outside our shard_map (the sampler, the runner's glue)
    lets the compiler propagate shardings; the model step itself is placed by hand."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < config.size:
        raise ValueError(f"mesh pipeline={config.pipeline} x tensor={config.tensor} needs "
                         f"{config.size} devices, but only {len(devices)} are available")
    grid = np.array(devices[: config.size]).reshape(config.pipeline, config.tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def make_replica_meshes(config: MeshConfig,
                        devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
    """`config.replicas` disjoint meshes, replica r on devices [r*size, (r+1)*size)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < config.total_devices:
        raise ValueError(
            f"{config.replicas} replicas of pipeline={config.pipeline} x tensor={config.tensor} "
            f"need {config.total_devices} devices, but only {len(devices)} are available")
    size = config.size
    return [make_mesh(config, devices[r * size:(r + 1) * size]) for r in range(config.replicas)]
