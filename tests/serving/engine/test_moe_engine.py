"""The engine serves mixture-of-experts models with nothing changed above the model: staggered
requests (chunked prefills mixed with decode rows) compile nothing after warm-up, and each
request's greedy tokens are the ones the model gives it run alone -- for a Mixtral-style and a
Qwen2-MoE-style model (shared expert, q/k/v biases), and for a model whose router sends every
token of every row to the same experts (the other groups empty).  Each batch also holds a row
whose prompt is one token repeated: attention over identical values returns that value, so all
its positions have the same hidden state (up to rounding) in every layer and its tokens all pick
the same experts, next to rows whose tokens spread over them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.serving.engine.conftest import TINY_ENGINE_CONFIG, run_joining, tokens_of
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import init_params
from xlaserve.models.moe import route
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.sequence_generator import SequenceGenerator
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.sharding.mesh import make_mesh

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, eos_token_ids=(2,))
MODELS = {
    "mixtral": ModelConfig(**BASE, architecture="mixtral", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=96, norm_topk_prob=True),
    "qwen2-moe": ModelConfig(**BASE, architecture="qwen2_moe", num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64, attention_bias=True),
    "olmoe": ModelConfig(**BASE, architecture="olmoe", num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, qk_norm=True, qk_norm_span="all"),
}


def moe_params(config: ModelConfig, same_experts: bool) -> dict:
    params = init_params(config, 5, scale=0.5)
    layers = dict(params["layers"])
    # A strong router (gates far from uniform); zero: every logit ties, and top-k keeps the
    # lowest ids, so every token goes to experts 0 .. k-1.
    layers["router"] = layers["router"] * (0.0 if same_experts else 8.0)
    return {**params, "layers": layers}


@pytest.mark.parametrize("same_experts", [False, True], ids=["routed", "all-same-expert"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_moe_engine_matches_alone_and_compiles_nothing(model_dir, name: str,
                                                       same_experts: bool) -> None:
    config = MODELS[name]
    params = moe_params(config, same_experts)
    h = jnp.asarray(np.random.default_rng(3).standard_normal((32, config.hidden_size)),
                    jnp.float32)
    _, chosen = route(config, h, jnp.asarray(params["layers"]["router"][0]))
    picked = set(np.asarray(chosen).ravel().tolist())
    if same_experts:
        assert picked == set(range(config.num_experts_per_tok))
    else:
        assert len(picked) == config.num_experts
    engine = LLMEngine(params, config, Tokenizer.load(model_dir), make_mesh(),
                       TINY_ENGINE_CONFIG)
    engine.runner.warmup()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 49152, n)) for n in (5, 21, 40, 9, 33, 2)]
    prompts[4] = [977] * 33   # one row whose prompt tokens all route alike
    out, compiled = run_joining(engine, prompts)
    assert compiled == 0, f"{compiled} compilations after warm-up"
    alone = SequenceGenerator(engine.runner.params, config, max_len=64,
                              attention_backend=engine.runner.backend)
    outputs = []
    for i, ids in enumerate(prompts):
        want = list(alone.generate(ids, 12, stop_ids=()))
        assert tokens_of(out[f"r{i}"]) == want, i
        outputs.append(want)
    # Not a degenerate model: requests get different continuations.
    assert len({tuple(o) for o in outputs}) > 1
