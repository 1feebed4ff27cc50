"""The compiled step really is sharded: the collectives in its HLO are the ones Megatron tensor
parallelism and a pipeline need, inside the loops where they belong, and no weight is gathered."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.mesh import MeshConfig, make_mesh
from xlaserve.sharding.parallel_forward import make_sharded_forward

from .scenarios import BLOCK_SIZE, NUM_BLOCKS, TINY, decode_after_prefill, tiny_params


def compiled_hlo(pipeline: int, tensor: int) -> tuple[str, tuple[int, ...]]:
    """The decode step's optimised HLO, KV donated as the runner does; and the local KV shape."""
    mesh = make_mesh(MeshConfig(pipeline=pipeline, tensor=tensor))
    layout = ShardLayout.create(TINY, mesh)
    fwd = make_sharded_forward(TINY, mesh)
    params = layout.shard_params(tiny_params(TINY), mesh)
    kv = layout.init_kv_cache(mesh, NUM_BLOCKS, BLOCK_SIZE)
    step = decode_after_prefill(TINY.vocab_size)

    def go(params, kv):
        return fwd(params, TINY, jnp.asarray(step.tokens), jnp.asarray(step.positions), kv,
                   step.meta, logits_index=jnp.asarray(step.logits_index))

    hlo = jax.jit(go, donate_argnums=1).lower(params, kv).compile().as_text()
    return hlo, kv.k.addressable_shards[0].data.shape


def computations(hlo: str) -> dict[str, str]:
    """HLO computation name -> its text."""
    out: dict[str, str] = {}
    name = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            name = header.group(1)
            out[name] = ""
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name] += line + "\n"
    return out


def loop_bodies(hlo: str) -> list[str]:
    """The texts of every while-loop body (lax.scan over layers, the pipeline's ticks)."""
    comps = computations(hlo)
    return [comps[b] for b in re.findall(r"body=%([\w.\-]+)", hlo)]


def count(text: str, op: str) -> int:
    return len(re.findall(rf"\s{op}\(", text))


@pytest.mark.parametrize("pipeline,tensor", [(1, 2), (2, 1), (2, 2)],
                         ids=["tp2", "pp2", "tp2xpp2"])
def test_collectives_of_real_sharding(pipeline: int, tensor: int) -> None:
    hlo, local_kv = compiled_hlo(pipeline, tensor)
    bodies = loop_bodies(hlo)
    assert bodies, "expected the layer scan to compile to a while loop"
    # Nothing is ever gathered: every device computes with its own weight slices and the logits
    # stay split over the vocabulary.
    for op in ("all-gather", "all-to-all", "reduce-scatter"):
        assert count(hlo, op) == 0, f"{op} in the compiled step"
    per_layer_reduces = max(count(b, "all-reduce") for b in bodies)
    permutes = max(count(b, "collective-permute") for b in bodies)
    if tensor > 1:
        # One loop body is a layer: the attention output (wo) and the MLP output (w_down) are
        # each summed over the tensor shards, every layer.
        assert per_layer_reduces == 2, per_layer_reduces
    else:
        assert per_layer_reduces == 0 and count(hlo, "all-reduce") == 1  # hand-off to all stages
    if pipeline > 1:
        # One loop body is a pipeline tick: activations go to the next stage.
        assert permutes == 1, permutes
    else:
        assert count(hlo, "collective-permute") == 0
    # The donated cache is updated in place: aliased to the output, never copied whole.
    assert "input_output_alias" in hlo
    layers, blocks, block_size, heads, dim = local_kv
    for shape in (local_kv, (layers * blocks * block_size, heads, dim)):
        dims = ",".join(map(str, shape))
        assert not re.search(rf"= f32\[{dims}\]\S* copy\(", hlo), f"KV {shape} copied"
