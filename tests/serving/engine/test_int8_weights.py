"""An engine serving int8 weights: nothing compiles after warm-up, and staggered requests get
the tokens the same int8 model gives each one run alone."""

from __future__ import annotations

import numpy as np

from tests.serving.engine.conftest import TINY_ENGINE_CONFIG, collect, request, tokens_of
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import init_params
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.generate import SamplingOptions, SequenceGenerator
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.sharding.mesh import make_mesh

INT8 = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=32, eos_token_ids=(2,),
                   quantization="int8")


def test_int8_engine_compiles_nothing_after_warmup_and_matches_alone(model_dir) -> None:
    engine = LLMEngine(init_params(INT8, 3, scale=0.5), INT8, Tokenizer.load(model_dir),
                       make_mesh(), TINY_ENGINE_CONFIG)
    engine.runner.warmup()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 49152, n)) for n in (5, 21, 40, 9, 33, 2)]
    with CompileCounter() as compiles:
        for i, ids in enumerate(prompts[:3]):
            engine.add(request(f"r{i}", ids, max_tokens=12, ignore_eos=True))
        engine.step()
        for i, ids in enumerate(prompts[3:], start=3):   # join while the first ones decode
            engine.add(request(f"r{i}", ids, max_tokens=12, ignore_eos=True))
        out = collect(engine)
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"
    alone = SequenceGenerator(engine.runner.params, INT8, max_len=64,
                              attention_backend=engine.runner.backend)
    for i, ids in enumerate(prompts):
        want = list(alone.generate(ids, SamplingOptions(max_tokens=12), stop_ids=()))
        assert tokens_of(out[f"r{i}"]) == want, i
