"""Logical axis names -> mesh axes: the one table that decides where every array lives.

Models annotate parameters and caches with logical names only (`embed`, `heads`, ...); this
table maps each name to a mesh axis or to None (replicated). A one-device mesh is the default,
not a special case: every rule still applies, over axes of size one.
"""

from __future__ import annotations

from collections.abc import Mapping

from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Logical axis -> mesh axis (None = replicated).  Megatron-style tensor parallelism: attention
# heads, KV heads, the MLP hidden dimension and the vocabulary are split over `tensor`; the
# stacked layer axis is split over `pipeline` (one contiguous slice of layers per stage).
DEFAULT_RULES: Mapping[str, str | None] = {
    "layers": "pipeline",
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "blocks": None,
    "block_size": None,
    "batch": None,
    "seq": None,
}

LogicalAxes = tuple[str | None, ...]


def partition_spec(axes: LogicalAxes, rules: Mapping[str, str | None] = DEFAULT_RULES,
                   mesh: Mesh | None = None) -> PartitionSpec:
    """The PartitionSpec for an array annotated with logical `axes`.

    Mesh axes of size one are dropped, so that the same annotation works on any mesh."""
    out: list[str | None] = []
    for name in axes:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        target = rules[name]
        if target is not None and mesh is not None and target not in mesh.shape:
            target = None
        out.append(target)
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, axes: LogicalAxes,
                   rules: Mapping[str, str | None] = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(axes, rules, mesh))
