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


def test_gemma3_image_text_checkpoint_serves_its_text_tower(tmp_path: Path, caplog) -> None:
    """A `gemma3` (Gemma3ForConditionalGeneration) checkpoint: its text tower converted, the
    vision weights skipped with one log line, text logits as transformers gives them."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from tests.moe_models import save_with_tokenizer
    from xlaserve.checkpoints.convert import convert_hf

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                query_pre_attn_scalar=64, sliding_window=24, max_position_embeddings=512,
                rms_norm_eps=1e-6)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                       image_token_index=255, boi_token_index=253, eoi_token_index=254)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(0.1 * torch.randn_like(p)) if "norm" in name else p.mul_(3.0)
    save_with_tokenizer(hf, tmp_path / "hf")
    with caplog.at_level("INFO", logger="xlaserve.checkpoints.convert"):
        convert_hf(tmp_path / "hf", tmp_path / "ours", quiet=True)
    assert [r.getMessage() for r in caplog.records if "vision" in r.getMessage()] == [
        "gemma3: serving the text tower; 34 vision tensors skipped"]
    model = load_model(tmp_path / "ours")
    assert model.config.architecture == "gemma3" and model.config.qk_norm
    ids = _IDS[:60]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert max_rel_error(full_logits(model.params, model.config, ids), ref) < 1e-4
