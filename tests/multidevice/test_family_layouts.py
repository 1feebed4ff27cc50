"""The dense families on the 8-device mesh (tests/family_models.py): converted from tiny
random transformers checkpoints, restored straight into tp2, pp2 and tp2 x pp2, logits equal
to transformers' within 1e-4 relative; Gemma 3's sliding / full layer pattern differs between
its two pipeline stages, so each stage must pick its layers' kinds by their index in the
model, which the ragged-steps test checks against the one-device forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.family_models import convert_family
from tests.helpers import max_rel_error
from xlaserve.checkpoints.store import load_config, load_params
from xlaserve.models.llama import init_kv_cache
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.mesh import MeshConfig, make_mesh
from xlaserve.sharding.parallel_forward import make_sharded_forward

from .scenarios import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    decode_after_prefill,
    make_step,
    ragged_prefill,
    reference,
    run,
    used_blocks,
)

LAYOUTS = {"tp2": MeshConfig(tensor=2), "pp2": MeshConfig(pipeline=2),
           "tp2xpp2": MeshConfig(tensor=2, pipeline=2)}
FAMILIES = ("qwen2-gqa", "qwen3-d128", "gemma2-d256", "gemma3-d64", "phi3-longrope-partial",
            "granite")
IDS = np.random.default_rng(1).integers(3, 256, size=100).tolist()


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray]]:
    """family -> (converted folder, transformers' logits of IDS)."""
    out = {}
    for name in FAMILIES:
        folder, hf = convert_family(name, tmp_path_factory.mktemp(name))
        with torch.no_grad():
            out[name] = (folder, hf(torch.tensor([IDS])).logits[0].numpy())
    return out


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_layout_matches_transformers(family_models, family: str,
                                            layout_name: str) -> None:
    folder, want = family_models[family]
    config = load_config(folder)
    mesh = make_mesh(LAYOUTS[layout_name])
    layout = ShardLayout.create(config, mesh)
    params = load_params(folder, config, mesh)
    fwd = make_sharded_forward(config, mesh)
    step = make_step([IDS], [0], width=7, block_size=16, all_logits=True)
    logits, _ = run(fwd, params, config, step, layout.init_kv_cache(mesh, 8, 16))
    err = max_rel_error(logits, want)
    print(f"{family} {layout_name}: max relative logit error vs transformers {err:.2e}")
    assert err < 1e-4


@pytest.mark.parametrize("layout_name", ["pp2", "tp2xpp2"])
def test_gemma3_stages_match_one_device_on_ragged_steps(family_models, layout_name) -> None:
    """Ragged prefill rows (microbatches cut through rows), then a decode step: logits and the
    used KV blocks as on one device."""
    folder, _ = family_models["gemma3-d64"]
    config = load_config(folder)
    assert config.layer_kinds[:2] != config.layer_kinds[2:]   # the stages differ
    one = load_params(folder, config, make_mesh())
    steps = [ragged_prefill(config.vocab_size), decode_after_prefill(config.vocab_size)]
    expected = reference(one, config, steps, init_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE))
    mesh = make_mesh(LAYOUTS[layout_name])
    layout = ShardLayout.create(config, mesh)
    fwd = make_sharded_forward(config, mesh)
    params = load_params(folder, config, mesh)
    kv = layout.init_kv_cache(mesh, NUM_BLOCKS, BLOCK_SIZE)
    for step, (want, want_kv) in zip(steps, expected):
        logits, kv = run(fwd, params, config, step, kv)
        np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5 * np.abs(want).max())
        for got, ref in zip(used_blocks(kv), used_blocks(want_kv)):
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
