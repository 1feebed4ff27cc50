"""An engine serving int8 weights (and an int8 KV cache): nothing compiles after warm-up, and
staggered requests get the tokens the same int8 model gives each one run alone."""

from __future__ import annotations

import numpy as np
import pytest

from tests.serving.engine.conftest import TINY_ENGINE_CONFIG, assert_joining_matches_alone
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import init_params
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.sharding.mesh import make_mesh

INT8 = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=32, eos_token_ids=(2,),
                   quantization="int8")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_int8_engine_compiles_nothing_after_warmup_and_matches_alone(model_dir,
                                                                     kv_cache_dtype) -> None:
    config = TINY_ENGINE_CONFIG.with_args(kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(init_params(INT8, 3, scale=0.5), INT8, Tokenizer.load(model_dir),
                       make_mesh(), config)
    assert (engine.runner.kv.k.dtype == np.int8) == (kv_cache_dtype == "int8")
    assert_joining_matches_alone(engine, INT8, config, seed=0)
