"""An engine over a 16-bit KV cache (float16, bfloat16; float32 weights): nothing compiles after
warm-up, and staggered requests get the tokens the same model and cache dtype give each one run
alone.  On CPU the attention kernel reads the cache in place for decode tokens and widens it for
prefill chunks (kernels/cpu/native/paged_attention.cc), so both paths are in every request."""

from __future__ import annotations

import numpy as np
import pytest

from tests.serving.engine.conftest import (
    TINY_CONFIG,
    TINY_ENGINE_CONFIG,
    assert_joining_matches_alone,
)
from xlaserve.models.llama import init_params
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.sharding.mesh import make_mesh


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_16_bit_kv_engine_compiles_nothing_after_warmup_and_matches_alone(model_dir,
                                                                          kv_cache_dtype) -> None:
    config = TINY_ENGINE_CONFIG.with_args(kv_cache_dtype=kv_cache_dtype)
    params = init_params(TINY_CONFIG, 5, scale=0.5)
    engine = LLMEngine(params, TINY_CONFIG, Tokenizer.load(model_dir), make_mesh(), config)
    assert engine.runner.kv.k.dtype == np.dtype(kv_cache_dtype)
    assert_joining_matches_alone(engine, TINY_CONFIG, config, seed=1)
