"""Logical axis names -> mesh axes: the one table that decides where every array lives.

Models annotate parameters and caches with logical names only (`embed`, `heads`, ...); this
table maps each name to a mesh axis or to None (replicated). A one-device mesh is the default,
not a special case: every rule still applies, over axes of size one.
"""

from __future__ import annotations

from collections.abc import Mapping

from jax.sharding import PartitionSpec

from xlaserve.models.config import ModelConfig
from xlaserve.sharding.mesh import MeshConfig

# Logical axis -> mesh axis (None = replicated).  Megatron-style tensor parallelism: attention
# heads, KV heads, the MLP hidden dimension and the vocabulary are split over `tensor`; the
# stacked layer axis is split over `pipeline` (one contiguous slice of layers per stage); a
# mixture-of-experts model's stacked experts over `expert` (each expert's hidden dimension is
# `mlp`, so tensor parallelism composes inside the experts).
DEFAULT_RULES: Mapping[str, str | None] = {
    "layers": "pipeline",
    "experts": "expert",
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


def model_rules(model: ModelConfig, mesh: MeshConfig) -> dict[str, str | None]:
    """DEFAULT_RULES specialised to one model on one mesh; refuses layouts that cannot work.

    Query heads, the mlp hidden dimension and the layers must divide evenly (a ValueError shows
    the numbers).  KV heads are split over `tensor` only when `tensor` divides them; otherwise
    (fewer KV heads than shards, e.g. 8 query / 2 KV heads at tensor=4) every shard keeps all
    KV heads and computes them redundantly.  A vocabulary that `tensor` does not divide is
    replicated."""
    tp, pp, ep = mesh.tensor, mesh.pipeline, mesh.expert
    problems = []
    if model.num_heads % tp:
        problems.append(f"tensor={tp} does not divide num_heads={model.num_heads}")
    hidden = {"moe_intermediate_size": model.moe_intermediate_size,
              "shared_expert_intermediate_size": model.shared_expert_intermediate_size} \
        if model.is_moe else {"intermediate_size": model.intermediate_size}
    for name, size in hidden.items():
        if size % tp:
            problems.append(f"tensor={tp} does not divide {name}={size}")
    if model.num_layers % pp:
        problems.append(f"pipeline={pp} does not divide num_layers={model.num_layers}")
    if tp > 1 and model.qk_norm and model.qk_norm_span == "all":
        problems.append(f"tensor={tp}: {model.architecture}'s q/k norm spans every head, so "
                        f"the heads cannot be split (use expert or pipeline parallelism)")
    if ep > 1 and not model.is_moe:
        problems.append(f"expert={ep} needs a mixture-of-experts model, and "
                        f"{model.architecture!r} has a dense MLP")
    elif model.is_moe and model.num_experts % ep:
        problems.append(f"expert={ep} does not divide num_experts={model.num_experts}")
    if problems:
        raise ValueError("cannot shard the model over mesh {}: {}".format(
            mesh.describe(), "; ".join(problems)))
    rules = dict(DEFAULT_RULES)
    if model.num_kv_heads % tp:
        rules["kv_heads"] = None
    if model.vocab_size % tp:
        rules["vocab"] = None
    return rules


def partition_spec(axes: LogicalAxes, rules: Mapping[str, str | None]) -> PartitionSpec:
    """The PartitionSpec for an array annotated with logical `axes` (None: replicated)."""
    for name in axes:
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
    return PartitionSpec(*(None if name is None else rules[name] for name in axes))
