"""The `expert` axis in the rules table: where a MoE model's parameters go, and the layouts
that are refused (with the numbers) -- bookkeeping over shapes, no devices needed."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

from xlaserve.models.config import ModelConfig
from xlaserve.models.families import config_from_hf
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.mesh import MeshConfig

MOE = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=4,
                  num_heads=8, num_kv_heads=4, head_dim=16, architecture="qwen2_moe",
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, attention_bias=True)
DENSE = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=4,
                    num_heads=8, num_kv_heads=4, head_dim=16)


def test_expert_weights_split_over_expert_and_tensor() -> None:
    layout = ShardLayout.create(MOE, MeshConfig(pipeline=2, expert=2, tensor=2))
    specs = layout.param_specs()["layers"]
    assert specs["we_gate"] == P("pipeline", "expert", None, "tensor")
    assert specs["we_down"] == P("pipeline", "expert", "tensor", None)
    assert specs["router"] == P("pipeline", None, None)      # every shard routes every token
    assert specs["ws_gate"] == P("pipeline", None, "tensor")  # shared expert: like a dense MLP
    assert specs["bq"] == P("pipeline", "tensor", None)
    assert layout.kv_spec() == P("pipeline", None, None, "tensor", None)   # not over expert
    assert layout.experts_split and layout.experts_per_shard == 4


def test_refused_layouts_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"mesh pipeline=1 x expert=2 x tensor=1: expert=2 "
                                         r"needs a mixture-of-experts model, and 'llama' has a "
                                         r"dense MLP"):
        ShardLayout.create(DENSE, MeshConfig(expert=2))
    with pytest.raises(ValueError, match=r"expert=3 does not divide num_experts=8"):
        ShardLayout.create(MOE, MeshConfig(expert=3))
    with pytest.raises(ValueError, match=r"tensor=4 does not divide "
                                         r"moe_intermediate_size=.*shared_expert_intermediate"):
        ShardLayout.create(MOE.replace(moe_intermediate_size=34,
                                       shared_expert_intermediate_size=50),
                           MeshConfig(tensor=4))
    assert MeshConfig.from_dict({"expert": 2, "tensor": 2}).size == 4


def test_moe_config_errors() -> None:
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 is more than num_experts=8"):
        MOE.replace(num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"moe_intermediate_size must be a positive int for a "
                                         r"qwen2_moe model, got 0"):
        MOE.replace(moe_intermediate_size=0)
    with pytest.raises(ValueError, match=r"num_experts=4 on architecture 'llama', which has a "
                                         r"dense MLP"):
        DENSE.replace(num_experts=4)
    for mode in ("int8", "fp8"):
        with pytest.raises(ValueError, match=rf"quantization='{mode}': quantized weights are "
                                             r"not supported for mixture-of-experts"):
            MOE.replace(quantization=mode)
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\]"):
        config_from_hf({"model_type": "qwen2_moe", "vocab_size": 8, "hidden_size": 8,
                             "intermediate_size": 8, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "num_experts": 4,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                             "mlp_only_layers": [1]})
