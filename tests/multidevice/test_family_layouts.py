"""The dense families on the 8-device mesh (tests/family_models.py): converted from tiny
random transformers checkpoints (two of them also from GGUF files), restored straight into
tp2, pp2 and tp2 x pp2, logits equal to transformers' within 1e-4 relative; Gemma 3's
sliding / full layer pattern differs between its two pipeline stages, so each stage must pick
its layers' kinds by their index in the model, which the ragged-steps test checks against
the one-device forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.family_models import convert_family
from tests.helpers import max_rel_error
from xlaserve.checkpoints.store import load_config, load_params
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.mesh import MeshConfig, make_mesh
from xlaserve.sharding.parallel_forward import make_sharded_forward

from .scenarios import assert_folder_matches_one_device, make_step, run

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


@pytest.mark.parametrize("family", ["gemma3-d64", "granite"])
def test_family_gguf_at_tp2xpp2_matches_transformers(tmp_path, family: str) -> None:
    """The same from a GGUF in llama.cpp's layout (Gemma's 1 + w norms, Granite's permuted
    q/k rows), converted and restored into tp2 x pp2."""
    from tests.checkpoints.test_family_gguf import write_family_gguf
    from tests.family_models import FAMILY_VARIANTS, hf_family_model
    from xlaserve.checkpoints.convert import convert_gguf

    variant = dict(FAMILY_VARIANTS[family])
    if family.startswith("gemma"):
        variant["query_pre_attn_scalar"] = variant["head_dim"]   # GGUF's rule
    hf = hf_family_model(variant)
    write_family_gguf(hf, tmp_path / "model.gguf")
    convert_gguf(tmp_path / "model.gguf", tmp_path / "ours", quiet=True)
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0].numpy()
    config = load_config(tmp_path / "ours")
    mesh = make_mesh(LAYOUTS["tp2xpp2"])
    layout = ShardLayout.create(config, mesh)
    params = load_params(tmp_path / "ours", config, mesh)
    step = make_step([IDS], [0], width=7, block_size=16, all_logits=True)
    logits, _ = run(make_sharded_forward(config, mesh), params, config, step,
                    layout.init_kv_cache(mesh, 8, 16))
    assert max_rel_error(logits, want) < 1e-4


@pytest.mark.parametrize("layout_name", ["pp2", "tp2xpp2"])
def test_gemma3_stages_match_one_device_on_ragged_steps(family_models, layout_name) -> None:
    """Ragged prefill rows (microbatches cut through rows), then a decode step: logits and the
    used KV blocks as on one device."""
    folder, _ = family_models["gemma3-d64"]
    kinds = load_config(folder).layer_kinds
    assert kinds[:2] != kinds[2:]   # the stages differ
    assert_folder_matches_one_device(folder, LAYOUTS[layout_name])
