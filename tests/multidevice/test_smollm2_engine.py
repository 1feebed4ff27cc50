"""SmolLM2-135M served by the engine on tensor=3 (9 heads, 3 KV heads split three ways) gives the
one-device greedy tokens for a chat prompt."""

from __future__ import annotations

import dataclasses

from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.engine.factory import build_engines
from xlaserve.serving.types import GenerationRequest, SamplingParams
from xlaserve.sharding.mesh import MeshConfig

# Two buckets: one decode row, one 64-token prefill chunk; 8-block tables.
SMALL = EngineConfig.from_args(max_model_len=128, block_size=16, num_kv_blocks=16, max_num_seqs=1,
                     max_num_batched_tokens=64, max_prefill_chunk=64,
                     min_step_tokens=64, min_table_width=8)


def greedy(engine, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    engine.add(GenerationRequest("chat", prompt, SamplingParams(max_tokens=max_tokens,
                                                                temperature=0.0)))
    ids, text = [], ""
    for event in engine.run_until_done():
        assert event.error is None, event
        ids.extend(event.token_ids)
        text += event.text
    return ids, text


def test_smollm2_tp3_generates_the_one_device_tokens(model_dir) -> None:
    [one] = build_engines(model_dir, SMALL)
    prompt = one.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of "
                                                                   "France?"}])
    assert 5 < len(prompt) <= 64
    want_ids, want_text = greedy(one, prompt, 16)
    [tp3] = build_engines(model_dir, dataclasses.replace(SMALL, mesh=MeshConfig(tensor=3)))
    assert tp3.runner.layout.kv_heads_per_shard == 1 and tp3.runner.layout.vocab_split
    ids, text = greedy(tp3, prompt, 16)
    print(f"smollm2 tp3: {len(ids)} tokens identical to one device: {text!r}")
    assert ids == want_ids and text == want_text
    assert "Paris" in text
