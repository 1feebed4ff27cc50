"""The workload registry: `mixed` has the promised shape, is seeded, and fits its engine."""

from __future__ import annotations

import pytest

from xlaserve.bench.corpus import CORPUS
from xlaserve.bench.workload import WORKLOADS, get_workload
from xlaserve.serving.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.load(model_dir)


def test_mixed_shape(tokenizer) -> None:
    w = get_workload("mixed").build(tokenizer, seed=0)
    prompts = [len(r.prompt_token_ids) for r in w.requests]
    outputs = [r.num_output_tokens for r in w.requests]
    assert len(w.requests) == 64
    assert min(prompts) == 16 and max(prompts) == 512
    assert min(outputs) == 1 and max(outputs) == 256
    # long-tailed: most outputs short, a few long
    assert sorted(outputs)[32] <= 48 and sum(o >= 100 for o in outputs) >= 2
    assert len({r.request_id for r in w.requests}) == 64
    # prompts are windows of the shipped English text
    text = tokenizer.decode(list(w.requests[5].prompt_token_ids))
    assert text.strip().split()[1] in CORPUS


def test_seeded(tokenizer) -> None:
    spec = get_workload("mixed")
    assert spec.build(tokenizer, seed=3) == spec.build(tokenizer, seed=3)
    assert spec.build(tokenizer, seed=3) != spec.build(tokenizer, seed=4)
    assert len(spec.build(tokenizer, seed=0, num_requests=5).requests) == 5


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_engine_config_holds_every_running_request(name) -> None:
    spec = WORKLOADS[name]
    for batch in (1, 8, 64):
        c = spec.engine_config(batch).scheduler
        assert c.max_num_seqs >= batch
        assert c.max_model_len >= spec.prompt_max + spec.output_max
        per_seq = c.max_model_len // c.block_size
        assert c.num_kv_blocks - 1 >= c.max_num_seqs * per_seq
