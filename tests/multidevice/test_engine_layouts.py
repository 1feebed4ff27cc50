"""The engine serves the same greedy tokens on every layout, by configuration alone.

One tiny random model folder; `build_engines(folder, EngineConfig(mesh=...))` restores it onto
each layout's mesh(es), places the KV cache by the layout and compiles every bucket.  A mixed
workload (chunked prefill + decode, staggered adds) must then produce exactly the one-device
tokens, with no compilation after warm-up."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.engine.factory import build_engines
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.memory import format_layout_report, layout_report
from xlaserve.sharding.mesh import MeshConfig

from .engine_workload import ENGINE, run_workload, save_model_folder, workload
from .scenarios import TINY, tiny_params

LAYOUTS = {"tp2": MeshConfig(tensor=2), "tp4": MeshConfig(tensor=4),
           "pp2": MeshConfig(pipeline=2), "tp2xpp2": MeshConfig(pipeline=2, tensor=2)}


def config_for(mesh: MeshConfig) -> EngineConfig:
    return dataclasses.replace(ENGINE, mesh=mesh)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, model_dir):
    params = jax.tree_util.tree_map(np.asarray, tiny_params(TINY, seed=11))
    return save_model_folder(tmp_path_factory.mktemp("tiny") / "model", params, TINY, model_dir)


@pytest.fixture(scope="module")
def one_device(tiny_folder):
    [engine] = build_engines(tiny_folder, ENGINE)
    assert engine.runner.mesh.devices.size == 1
    work = workload(TINY.vocab_size)
    [out] = run_workload([engine], work)
    # ignore_eos: every request runs to its max_tokens.
    assert {rid: len(ids) for rid, (ids, _) in out.items()} == {
        r.request_id: r.sampling.max_tokens for _, r in work}
    margins = [m for _, ms in out.values() for m in ms]
    # Greedy choices are decided by a clear margin, far above float error across layouts.
    print(f"one device: {sum(len(i) for i, _ in out.values())} tokens, "
          f"min top-1/top-2 logprob margin {min(margins):.2e}")
    assert min(margins) > 1e-4
    return out


def tokens(out):
    return {rid: ids for rid, (ids, _) in out.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_serves_the_one_device_tokens(tiny_folder, one_device, name: str) -> None:
    mesh = LAYOUTS[name]
    [engine] = build_engines(tiny_folder, config_for(mesh))
    runner = engine.runner
    assert dict(runner.mesh.shape) == {"pipeline": mesh.pipeline, "expert": 1,
                                       "tensor": mesh.tensor}
    assert runner.kv.k.sharding.is_equivalent_to(runner.layout.kv_sharding(runner.mesh), 5)
    assert len(runner.compiled_shapes) == len(ENGINE.bucket_plan.shapes()) == 9
    with CompileCounter() as compiles:
        [out] = run_workload([engine], workload(TINY.vocab_size))
    assert compiles.count == 0, f"{name}: {compiles.count} compilations after warm-up"
    assert tokens(out) == tokens(one_device)
    print(f"{name}: {sum(len(i) for i in tokens(out).values())} tokens identical, "
          f"{engine.num_steps} steps, 0 compilations after warm-up "
          f"({runner.warmup_seconds:.1f}s warm-up)")


def test_two_tp2_replicas(tiny_folder, one_device) -> None:
    """Two replicas (devices 0-1 and 2-3), each its own engine, serve the workload side by
    side and each produces the one-device tokens."""
    engines = build_engines(tiny_folder, config_for(MeshConfig(tensor=2, replicas=2)))
    assert len(engines) == 2
    devices = [{d.id for d in e.runner.mesh.devices.flat} for e in engines]
    assert devices == [{0, 1}, {2, 3}]
    with CompileCounter() as compiles:
        outs = run_workload(engines, workload(TINY.vocab_size))
    assert compiles.count == 0
    for out in outs:
        assert tokens(out) == tokens(one_device)


def test_per_device_bytes_of_each_layout(tiny_folder) -> None:
    """layout_report prices every layout from shapes; the bytes a real engine placed on its
    first device (parameters + KV cache) are exactly those."""
    meshes = [MeshConfig(), *LAYOUTS.values()]
    report = layout_report(TINY, meshes, ENGINE.scheduler.num_kv_blocks,
                           ENGINE.scheduler.block_size)
    print("\n" + format_layout_report(report))
    one = report[0][1]
    for mesh, (name, got) in zip(meshes, report):
        layout = ShardLayout.create(TINY, mesh)
        assert got.params_total == one.params == TINY.num_params * 4
        assert got.kv == one.kv // mesh.size   # KV split over layers (pp) and KV heads (tp)
        assert got.params < one.params or mesh.size == 1
        if mesh in (LAYOUTS["tp2xpp2"], LAYOUTS["tp4"]):
            [engine] = build_engines(tiny_folder, config_for(mesh), warmup=False)
            device = engine.runner.mesh.devices.flat[0]

            def on_device(tree, device=device) -> int:
                return sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
                           for s in leaf.addressable_shards if s.device == device)

            assert on_device(engine.runner.params) == got.params, name
            assert on_device(engine.runner.kv) == got.kv, name
            assert layout.kv_heads_split
