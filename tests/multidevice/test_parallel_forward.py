"""The sharded forward equals the one-device forward: logits and KV cache, prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest

from xlaserve.checkpoints.store import load_config, load_params
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params, init_kv_cache
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.mesh import MeshConfig, make_mesh, make_replica_meshes
from xlaserve.sharding.parallel_forward import make_sharded_forward

from .scenarios import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    TINY,
    TINY_GQA,
    Step,
    decode_after_prefill,
    make_step,
    ragged_prefill,
    reference,
    run,
    tiny_params,
    used_blocks,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny_reference() -> tuple[Params, list[Step], list]:
    params = tiny_params(TINY)
    steps = [ragged_prefill(TINY.vocab_size), decode_after_prefill(TINY.vocab_size)]
    kv = init_kv_cache(TINY, NUM_BLOCKS, BLOCK_SIZE)
    return params, steps, reference(params, TINY, steps, kv)


def check_on_mesh(mesh, params, config: ModelConfig, steps, expected) -> list[float]:
    """Run `steps` on `mesh`, compare each step's logits and cache; return the max errors."""
    layout = ShardLayout.create(config, mesh)
    fwd = make_sharded_forward(config, mesh)
    placed = layout.shard_params(params, mesh)
    kv = layout.init_kv_cache(mesh, NUM_BLOCKS, BLOCK_SIZE)
    errors = []
    for step, (want_logits, want_kv) in zip(steps, expected):
        logits, kv = run(fwd, placed, config, step, kv)
        assert logits.shape == want_logits.shape
        assert kv.k.sharding.is_equivalent_to(layout.kv_sharding(mesh), 5)
        np.testing.assert_allclose(logits, want_logits, rtol=0, atol=TOL)
        for got, want in zip(used_blocks(kv), used_blocks(want_kv)):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
        errors.append(float(np.abs(logits - want_logits).max()))
    return errors


@pytest.mark.parametrize("pipeline,tensor", [(1, 1), (1, 2), (1, 4), (2, 1), (4, 1), (2, 2)],
                         ids=["one-device-mesh", "tp2", "tp4", "pp2", "pp4", "tp2xpp2"])
def test_layout_matches_one_device(tiny_reference, pipeline: int, tensor: int) -> None:
    params, steps, expected = tiny_reference
    mesh = make_mesh(MeshConfig(pipeline=pipeline, tensor=tensor))
    errors = check_on_mesh(mesh, params, TINY, steps, expected)
    print(f"pp{pipeline} tp{tensor}: max |logit error| prefill {errors[0]:.2e} "
          f"decode {errors[1]:.2e}")


def test_two_replicas_of_tp2xpp2(tiny_reference) -> None:
    """Two disjoint tp2 x pp2 meshes (devices 0-3, 4-7) each serve the model on their own."""
    params, steps, expected = tiny_reference
    meshes = make_replica_meshes(MeshConfig(pipeline=2, tensor=2, replicas=2))
    assert len(meshes) == 2
    devices = [set(m.devices.flat) for m in meshes]
    assert not devices[0] & devices[1] and len(devices[0] | devices[1]) == 8
    for mesh in meshes:
        check_on_mesh(mesh, params, TINY, steps, expected)


def test_replicated_kv_heads_at_tp4() -> None:
    """8 query heads, 2 KV heads, tensor=4: every shard keeps both KV heads."""
    config = TINY_GQA
    layout = ShardLayout.create(config, MeshConfig(tensor=4))
    assert not layout.kv_heads_split and layout.heads_per_shard == 2
    assert layout.kv_spec()[3] is None
    params = tiny_params(config, seed=3)
    steps = [ragged_prefill(config.vocab_size), decode_after_prefill(config.vocab_size)]
    expected = reference(params, config, steps, init_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE))
    check_on_mesh(make_mesh(MeshConfig(tensor=4)), params, config, steps, expected)


def test_smollm2_at_tp3(model_dir) -> None:
    """SmolLM2-135M: 9 query heads, 3 KV heads, split three ways, restored straight into tp3."""
    config = load_config(model_dir)
    mesh = make_mesh(MeshConfig(tensor=3))
    layout = ShardLayout.create(config, mesh)
    assert layout.kv_heads_split and layout.kv_heads_per_shard == 1
    assert layout.heads_per_shard == 3 and layout.vocab_split
    sharded = load_params(model_dir, config, mesh)
    one = load_params(model_dir, config, make_mesh())
    prompt = [1, 9690, 198, 2683, 359, 253]   # short; any in-vocabulary ids will do
    steps = [make_step([prompt], [0], width=1, block_size=16),
             make_step([[28]], [len(prompt)], width=1, block_size=16)]
    kv = init_kv_cache(config, 2, 16)
    expected = reference(one, config, steps, kv)
    fwd = make_sharded_forward(config, mesh)
    kv = layout.init_kv_cache(mesh, 2, 16)
    for step, (want, want_kv) in zip(steps, expected):
        logits, kv = run(fwd, sharded, config, step, kv)
        scale = float(np.abs(want).max())
        err = float(np.abs(logits - want).max())
        print(f"smollm2 tp3: max |logit error| {err:.2e} (max |logit| {scale:.1f})")
        assert err <= TOL * scale, (err, scale)
        assert (logits.argmax(-1) == want.argmax(-1)).all()
        for got, ref in zip(used_blocks(kv), used_blocks(want_kv)):
            np.testing.assert_allclose(got, ref, rtol=0, atol=TOL * float(np.abs(ref).max()))


def test_microbatches_follow_the_batch(tiny_reference) -> None:
    """pp2 with three microbatches requested on flat batches of 20 and 4 tokens: two (the
    largest divisor) are used, cutting through rows; both still match."""
    params, steps, expected = tiny_reference
    mesh = make_mesh(MeshConfig(pipeline=2))
    layout = ShardLayout.create(TINY, mesh)
    fwd = make_sharded_forward(TINY, mesh, num_microbatches=3)
    kv = layout.init_kv_cache(mesh, NUM_BLOCKS, BLOCK_SIZE)
    placed = layout.shard_params(params, mesh)
    for step, (want, _) in zip(steps, expected):
        logits, kv = run(fwd, placed, TINY, step, kv)
        np.testing.assert_allclose(logits, want, rtol=0, atol=TOL)
