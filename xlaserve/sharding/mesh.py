"""Device meshes: `pipeline x tensor` from a small config. One device is the default mesh."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("pipeline", "tensor")


@dataclass(frozen=True)
class MeshConfig:
    pipeline: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for name in ("pipeline", "tensor"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MeshConfig.{name} must be an int >= 1, got {value!r}")

    @property
    def size(self) -> int:
        return self.pipeline * self.tensor


def make_mesh(config: MeshConfig = MeshConfig(), devices: list[jax.Device] | None = None) -> Mesh:
    """A `pipeline x tensor` mesh over the first `config.size` devices (or `devices`).

    Axes are `AxisType.Auto`: the compiler propagates shardings from the inputs; we state
    them on parameters and caches and let XLA place the collectives."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < config.size:
        raise ValueError(f"mesh pipeline={config.pipeline} x tensor={config.tensor} needs "
                         f"{config.size} devices, but only {len(devices)} are available")
    grid = np.array(devices[: config.size]).reshape(config.pipeline, config.tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))
