"""Every dense family against transformers in float32 (tests/family_models.py): the whole
prompt at once, in chunks through the paged cache and token by token, with the jnp reference
and with the CPU kernels on packed weights (the engine's one-device layout); Gemma 2 with the
Pallas kernels too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.family_models import FAMILY_VARIANTS, convert_family
from tests.helpers import full_logits, max_rel_error
from xlaserve.models.llama import pack_params
from xlaserve.serving.loading import load_model

_IDS = np.random.default_rng(1).integers(3, 256, size=100).tolist()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """name -> (model, transformers' logits [100, V]), converted once for both backends."""
    out = {}
    for name in FAMILY_VARIANTS:
        folder, hf = convert_family(name, tmp_path_factory.mktemp(name))
        with torch.no_grad():
            out[name] = (load_model(folder), hf(torch.tensor([_IDS])).logits[0].numpy())
    return out


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", sorted(FAMILY_VARIANTS))
def test_family_logits_match_transformers(name: str, backend: str, converted: dict) -> None:
    model, ref = converted[name]
    params = pack_params(model.params) if backend == "cpu" else model.params
    c = model.config
    assert c.architecture == FAMILY_VARIANTS[name]["model_type"].removesuffix("_text")
    assert np.abs(ref).max() > 0.5   # logits large enough that the family's scales show
    whole = full_logits(params, c, _IDS, backend=backend)
    assert max_rel_error(whole, ref) < 1e-4
    chunked = full_logits(params, c, _IDS, chunk=23, backend=backend)
    assert max_rel_error(chunked, ref) < 1e-4
    decoded = full_logits(params, c, _IDS[:40], chunk=1, backend=backend)
    assert max_rel_error(decoded, ref[:40]) < 1e-4


def test_family_logits_with_the_pallas_kernels(converted: dict) -> None:
    """The Pallas kernels (interpreted on CPU) on the family whose attention differs most from
    Llama's: Gemma 2's soft caps, head_dim 256, sliding and full layers (the other families'
    differences lie outside the attention kernels); Triton, with no sliding-window decode, is
    refused for it by name."""
    from xlaserve.kernels.attention import check_model_backend

    model, ref = converted["gemma2-d256"]
    with pytest.raises(ValueError, match="'triton'.*gemma2.*sliding_window=24"):
        check_model_backend(model.config, "triton")
    whole = full_logits(model.params, model.config, _IDS, backend="pallas")
    assert max_rel_error(whole, ref) < 1e-4
    decoded = full_logits(model.params, model.config, _IDS[:12], chunk=1, backend="pallas")
    assert max_rel_error(decoded, ref[:12]) < 1e-4


def test_longrope_takes_its_short_factors_in_a_short_context(tmp_path: Path) -> None:
    """Phi-3's LongRoPE served at max_model_len <= original_max_position_embeddings (64 here)
    uses the short factors, which transformers uses for a sequence that short; beyond it the
    long ones (the parity above, on 100 tokens)."""
    folder, hf = convert_family("phi3-longrope-partial", tmp_path)
    model = load_model(folder)
    short = model.config.for_context(64)
    assert short.max_position_embeddings == 64 and model.config.for_context(512) == model.config
    ids = _IDS[:40]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert max_rel_error(full_logits(model.params, short, ids), ref) < 1e-4
    assert max_rel_error(full_logits(model.params, model.config, ids), ref) > 1e-3
