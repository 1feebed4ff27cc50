"""Mixture-of-experts models against Hugging Face transformers: tiny random Mixtral, Qwen2-MoE
(shared expert with its sigmoid gate, q/k/v biases, with and without norm_topk_prob) and
Qwen3-MoE (per-head q/k norms) and OLMoE (q/k norms over all heads), saved as HF safetensors,
converted, logits compared in float32
(all at once, in chunks through the paged cache, and token by token)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import full_logits, max_rel_error
from tests.moe_models import MOE_VARIANTS, convert_moe
from xlaserve.models.moe import route
from xlaserve.serving.loading import load_model


@pytest.mark.parametrize("name", sorted(MOE_VARIANTS))
def test_moe_logits_match_transformers(name: str, tmp_path: Path) -> None:
    folder, hf = convert_moe(name, tmp_path)
    model = load_model(folder)
    c = model.config
    assert c.is_moe and c.num_experts == hf.config.to_dict().get(
        "num_local_experts", hf.config.to_dict().get("num_experts"))
    ids = np.random.default_rng(1).integers(0, 256, size=90).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = full_logits(model.params, c, ids)
    assert max_rel_error(ours, ref) < 1e-5
    chunked = full_logits(model.params, c, ids, chunk=23)
    assert max_rel_error(chunked, ref) < 1e-5
    decoded = full_logits(model.params, c, ids[:20], chunk=1)
    assert max_rel_error(decoded, ref[:20]) < 1e-5


def test_routing_uses_every_expert_and_the_family_normalisation(tmp_path: Path) -> None:
    """The parity above is not vacuous: the sequence's tokens reach every expert, and the
    gates follow each family's rule (Mixtral's sum to one, Qwen2-MoE's without norm_topk_prob
    do not)."""
    import jax.numpy as jnp

    for name in ("mixtral", "qwen2-moe-shared"):
        folder, _ = convert_moe(name, tmp_path / name)
        model = load_model(folder)
        c = model.config
        h = jnp.asarray(np.random.default_rng(2).standard_normal((64, c.hidden_size)),
                        jnp.float32)
        gates, experts = route(c, h, model.params["layers"]["router"][0])
        assert set(np.asarray(experts).ravel().tolist()) == set(range(c.num_experts))
        sums = np.asarray(gates).sum(-1)
        if c.norm_topk_prob:
            np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
        else:
            assert sums.max() <= 1.0 + 1e-6 and sums.min() < 0.9
