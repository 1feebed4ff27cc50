"""Per-device memory of a layout: parameter and KV-cache bytes that one device holds.

Computed from shapes and PartitionSpecs alone (no arrays), so `xlaserve bench` and capacity
planning can price a layout before placing anything.  Replicated arrays count in full on every
device; a dimension split over a mesh axis of size n counts 1/n.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import kv_shape, param_shapes
from xlaserve.models.quantize import leaf_dtype
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.mesh import MeshConfig


@dataclass(frozen=True)
class DeviceBytes:
    params: int         # parameter bytes on one device
    kv: int             # KV-cache bytes (k and v) on one device
    params_total: int   # parameter bytes of the whole model (one copy)
    kv_total: int

    @property
    def total(self) -> int:
        return self.params + self.kv

    def describe(self) -> str:
        mib = 1 << 20
        return (f"per device: params {self.params / mib:.2f} MiB "
                f"(of {self.params_total / mib:.2f} MiB), KV {self.kv / mib:.2f} MiB "
                f"(of {self.kv_total / mib:.2f} MiB)")


def shard_shape(shape: tuple[int, ...], spec: PartitionSpec,
                axis_sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape of one device's block of an array of `shape` placed with `spec`."""
    out = []
    for i, dim in enumerate(shape):
        axis = spec[i] if i < len(spec) else None
        names = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
        n = math.prod(axis_sizes[a] for a in names)
        assert dim % n == 0, (shape, spec, axis_sizes)
        out.append(dim // n)
    return tuple(out)


def device_bytes(layout: ShardLayout, num_blocks: int, block_size: int,
                 kv_dtype: str | None = None) -> DeviceBytes:
    c = layout.model
    sizes = {"pipeline": layout.mesh.pipeline, "tensor": layout.mesh.tensor,
             "expert": layout.mesh.expert}
    leaves = jax.tree_util.tree_leaves_with_path(param_shapes(c),
                                                 is_leaf=lambda x: isinstance(x, tuple))
    items = [jnp.dtype(leaf_dtype(path, c.dtype, c.quantization)).itemsize
             for path, _ in leaves]
    shapes = [s for _, s in leaves]
    specs = jax.tree_util.tree_leaves(layout.param_specs(),
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))
    params = sum(math.prod(shard_shape(s, p, sizes)) * item
                 for s, p, item in zip(shapes, specs, items))
    params_total = sum(math.prod(s) * item for s, item in zip(shapes, items))
    kv_item = jnp.dtype(kv_dtype or c.dtype).itemsize
    shape = kv_shape(c, num_blocks, block_size, kv_dtype)
    kv = 2 * math.prod(shard_shape(shape, layout.kv_spec(), sizes)) * kv_item
    kv_total = 2 * math.prod(shape) * kv_item
    return DeviceBytes(params, kv, params_total, kv_total)


def layout_report(model: ModelConfig, meshes: Sequence[MeshConfig], num_blocks: int,
                  block_size: int, kv_dtype: str | None = None) -> list[tuple[str, DeviceBytes]]:
    """(name, per-device bytes) of `model` on each mesh, e.g. for `xlaserve bench` to print.

    Raises ValueError for a mesh the model cannot be laid out on."""
    out = []
    for mesh in meshes:
        layout = ShardLayout.create(model, mesh)
        out.append((mesh_name(mesh), device_bytes(layout, num_blocks, block_size, kv_dtype)))
    return out


def mesh_name(mesh: MeshConfig) -> str:
    sizes = (("ep", mesh.expert), ("tp", mesh.tensor), ("pp", mesh.pipeline))
    name = "x".join(f"{axis}{n}" for axis, n in sizes if n > 1) or "1 device"
    return f"{mesh.replicas} x {name}" if mesh.replicas > 1 else name


def format_layout_report(rows: Sequence[tuple[str, DeviceBytes]]) -> str:
    """A fixed-width table: one line per layout, MiB per device."""
    mib = 1 << 20
    lines = [f"{'layout':<14}{'params/dev MiB':>16}{'KV/dev MiB':>12}{'total/dev MiB':>15}"]
    for name, b in rows:
        lines.append(f"{name:<14}{b.params / mib:>16.2f}{b.kv / mib:>12.2f}{b.total / mib:>15.2f}")
    return "\n".join(lines)
