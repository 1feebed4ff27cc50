"""The engine serves a mixture-of-experts model on the expert-parallel presets by configuration
alone (configs/ep2.toml, ep4, ep2_tp2, ep2_pp2): the mixed workload's greedy tokens equal the
one-device engine's, nothing compiles after warm-up, and the bytes each device holds are the
ones `xlaserve bench layouts` prices."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import init_params
from xlaserve.serving.engine.factory import build_engines
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.sharding.memory import format_layout_report, layout_report
from xlaserve.sharding.mesh import MeshConfig

from .engine_workload import ENGINE, run_workload, save_model_folder, workload

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = ("ep2", "ep4", "ep2_tp2", "ep2_pp2")
# Qwen2-MoE style: 8 experts, top 2, a shared expert, q/k/v biases; 4 layers split by pp2.
TINY_MOE = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                       num_heads=8, num_kv_heads=4, head_dim=16, architecture="qwen2_moe",
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, attention_bias=True)


def tokens(out):
    return {rid: ids for rid, (ids, _) in out.items()}


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory, model_dir):
    params = init_params(TINY_MOE, 7, scale=0.1)
    params["layers"]["router"] = params["layers"]["router"] * 20.0   # peaked, varied routing
    params = jax.tree_util.tree_map(np.asarray, params)
    return save_model_folder(tmp_path_factory.mktemp("moe") / "model", params, TINY_MOE,
                             model_dir)


@pytest.fixture(scope="module")
def one_device(moe_folder):
    [engine] = build_engines(moe_folder, ENGINE)
    [out] = run_workload([engine], workload(TINY_MOE.vocab_size))
    margins = [m for _, ms in out.values() for m in ms]
    assert min(margins) > 1e-4   # greedy choices far above float error across layouts
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_ep_preset_serves_the_one_device_tokens(moe_folder, one_device, preset: str) -> None:
    mesh = MeshConfig.load(CONFIGS / f"{preset}.toml")
    assert mesh.expert == 2 or mesh.expert == 4
    [engine] = build_engines(moe_folder, dataclasses.replace(ENGINE, mesh=mesh))
    runner = engine.runner
    assert dict(runner.mesh.shape) == {"pipeline": mesh.pipeline, "expert": mesh.expert,
                                       "tensor": mesh.tensor}
    assert runner.layout.experts_per_shard == TINY_MOE.num_experts // mesh.expert
    with CompileCounter() as compiles:
        [out] = run_workload([engine], workload(TINY_MOE.vocab_size))
    assert compiles.count == 0, f"{preset}: {compiles.count} compilations after warm-up"
    assert tokens(out) == tokens(one_device)
    # Per-device bytes: the priced layout is what the engine placed on its first device.
    [(name, priced)] = layout_report(TINY_MOE, [mesh], ENGINE.scheduler.num_kv_blocks,
                                     ENGINE.scheduler.block_size)
    device = runner.mesh.devices.flat[0]

    def on_device(tree) -> int:
        return sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
                   for s in leaf.addressable_shards if s.device == device)

    assert on_device(runner.params) == priced.params, name
    assert on_device(runner.kv) == priced.kv, name
    print(f"{preset}: {sum(len(i) for i in tokens(out).values())} tokens identical, "
          f"0 compilations after warm-up\n"
          + format_layout_report(layout_report(TINY_MOE, [MeshConfig(), mesh], 64, 16)))
