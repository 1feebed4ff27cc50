"""Expert parallelism on the 8-device mesh: tiny random Mixtral and Qwen2-MoE models (saved by
transformers, converted, restored straight into each layout) match transformers' logits at
ep2, ep4, ep2 x tp2 and ep2 x pp2, and the one-device forward (logits and KV cache) on a ragged
prefill and a decode step; the compiled step's collectives are the expected ones and no expert
weight is gathered."""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.helpers import max_rel_error
from tests.moe_models import convert_moe
from xlaserve.checkpoints.store import load_config, load_params
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.mesh import MeshConfig, make_mesh
from xlaserve.sharding.parallel_forward import make_sharded_forward

from .scenarios import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_folder_matches_one_device,
    decode_after_prefill,
    make_step,
    run,
)
from .test_hlo import count, loop_bodies

LAYOUTS = {"ep2": MeshConfig(expert=2), "ep4": MeshConfig(expert=4),
           "ep2xtp2": MeshConfig(expert=2, tensor=2), "ep2xpp2": MeshConfig(expert=2, pipeline=2)}
FAMILIES = ("mixtral", "qwen2-moe-shared")   # 4 experts, top 2; 8 experts, top 2 + shared
IDS = np.random.default_rng(1).integers(0, 256, size=40).tolist()


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray]]:
    """family -> (converted folder, transformers' logits of IDS)."""
    out = {}
    for name in FAMILIES:
        folder, hf = convert_moe(name, tmp_path_factory.mktemp(name))
        with torch.no_grad():
            out[name] = (folder, hf(torch.tensor([IDS])).logits[0].numpy())
    return out


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_ep_layout_matches_transformers(moe_models, family: str, layout_name: str) -> None:
    folder, want = moe_models[family]
    config = load_config(folder)
    mesh = make_mesh(LAYOUTS[layout_name])
    layout = ShardLayout.create(config, mesh)
    assert layout.experts_split
    params = load_params(folder, config, mesh)   # each device reads only its experts
    local = params["layers"]["we_gate"].addressable_shards[0].data.shape   # [L/P, X/ep, E, F/tp]
    m = LAYOUTS[layout_name]
    assert local == (config.num_layers // m.pipeline, config.num_experts // m.expert,
                     config.hidden_size, config.moe_intermediate_size // m.tensor)
    fwd = make_sharded_forward(config, mesh)
    step = make_step([IDS], [0], width=3, block_size=16, all_logits=True)
    kv = layout.init_kv_cache(mesh, 4, 16)
    logits, _ = run(fwd, params, config, step, kv)
    err = max_rel_error(logits, want)
    print(f"{family} {layout_name}: max relative logit error vs transformers {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_ep_layout_matches_one_device_on_ragged_steps(moe_models, layout_name: str) -> None:
    """Four ragged prefill rows padded to 20 tokens (pp2 cuts microbatches through rows), then a
    decode step: logits and the used KV blocks as on one device."""
    folder, _ = moe_models["qwen2-moe-shared"]
    assert_folder_matches_one_device(folder, LAYOUTS[layout_name])


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_ep_step_collectives(moe_models, layout_name: str) -> None:
    """Per layer: one all-reduce of the MoE output over the expert (and tensor) ranks, plus the
    attention's over tensor; with pipeline stages one collective-permute per tick; no
    all-gather, all-to-all or reduce-scatter anywhere, so no expert weight moves; each device's
    program holds only its own experts' weights."""
    folder, _ = moe_models["qwen2-moe-shared"]
    config = load_config(folder)
    m = LAYOUTS[layout_name]
    mesh = make_mesh(m)
    layout = ShardLayout.create(config, mesh)
    fwd = make_sharded_forward(config, mesh)
    params = load_params(folder, config, mesh)
    kv = layout.init_kv_cache(mesh, NUM_BLOCKS, BLOCK_SIZE)
    step = decode_after_prefill(config.vocab_size)

    def go(params, kv):
        return fwd(params, config, jnp.asarray(step.tokens), jnp.asarray(step.positions), kv,
                   step.meta, logits_index=jnp.asarray(step.logits_index))

    import jax

    hlo = jax.jit(go, donate_argnums=1).lower(params, kv).compile().as_text()
    for op in ("all-gather", "all-to-all", "reduce-scatter"):
        assert count(hlo, op) == 0, f"{op} in the compiled EP step"
    bodies = loop_bodies(hlo)
    per_layer = max(count(b, "all-reduce") for b in bodies)
    assert per_layer == (2 if m.tensor > 1 else 1), per_layer
    permutes = max(count(b, "collective-permute") for b in bodies)
    assert permutes == (1 if m.pipeline > 1 else 0), permutes
    # The MoE all-reduce spans expert x tensor ranks: groups of m.expert * m.tensor devices.
    group = m.expert * m.tensor
    groups = re.findall(r"all-reduce\(.*?replica_groups=(\S+)", "\n".join(bodies))
    sizes = {len(re.findall(r"\d+", g.split("}")[0])) for g in groups}
    print(layout_name, "all-reduce groups:", sorted(set(groups)))
    assert group in sizes, (groups, group)
    layers = config.num_layers // m.pipeline
    local = (layers, config.num_experts // m.expert, config.hidden_size,
             config.moe_intermediate_size // m.tensor)
    full = (layers, config.num_experts, config.hidden_size,
            config.moe_intermediate_size // m.tensor)
    assert re.search(rf"f32\[{','.join(map(str, local))}\]", hlo)
    assert not re.search(rf"f32\[{','.join(map(str, full))}\]", hlo)


def test_olmoe_matches_transformers_where_its_heads_stay_whole(tmp_path: Path) -> None:
    """OLMoE's q/k norms span every head: expert and pipeline layouts match transformers, and
    a layout that splits the heads over `tensor` is refused, saying why."""
    folder, hf = convert_moe("olmoe", tmp_path)
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0].numpy()
    config = load_config(folder)
    assert config.qk_norm_span == "all"
    for name in ("ep2", "ep4", "ep2xpp2"):
        mesh = make_mesh(LAYOUTS[name])
        layout = ShardLayout.create(config, mesh)
        params = load_params(folder, config, mesh)
        step = make_step([IDS], [0], width=3, block_size=16, all_logits=True)
        logits, _ = run(make_sharded_forward(config, mesh), params, config, step,
                        layout.init_kv_cache(mesh, 4, 16))
        assert max_rel_error(logits, want) < 1e-5, name
    with pytest.raises(ValueError, match="q/k norm spans every head"):
        ShardLayout.create(config, make_mesh(LAYOUTS["ep2xtp2"]))
