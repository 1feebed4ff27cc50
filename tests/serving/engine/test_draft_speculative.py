"""Draft-model speculation on SmolLM2, its own first 8 layers as the draft: greedy outputs
token for token those of the engine without speculation (stop strings, max_tokens, logprobs
included), sampled requests served through the accept-or-resample path, nothing compiled after
warm-up, integrity of the pool and of the draft's progress after every step, and an abort
mid-verification that frees everything."""

from __future__ import annotations

import numpy as np
import pytest

from tests.serving.engine.conftest import ENGINE_CONFIG, new_engine, request, step_until_verifying
from tests.serving.engine.test_speculative import check_same, lookup_prompt, run, workload
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.engine.draft_model import make_draft_runner
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.serving.speculative import SpeculativeConfig

SPEC = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_layers=8)


@pytest.fixture(scope="module")
def draft_runner(smollm2):
    runner = make_draft_runner(smollm2.params, smollm2.config, smollm2.mesh,
                               ENGINE_CONFIG.with_args(speculative=SPEC))
    runner.warmup()
    return runner


def draft_engine(warm_engine, smollm2, draft_runner) -> LLMEngine:
    config = ENGINE_CONFIG.with_args(speculative=SPEC)
    return LLMEngine(smollm2.params, smollm2.config, smollm2.tokenizer, smollm2.mesh, config,
                     runner=warm_engine.runner, draft_runner=draft_runner)


def test_greedy_output_identical_and_nothing_compiles(warm_engine, smollm2, corpus_ids,
                                                      draft_runner) -> None:
    work = workload(corpus_ids, temperature=0.0)
    stop = {"look1": ("\n",)}
    base = run(new_engine(warm_engine, smollm2), work, stop)
    engine = draft_engine(warm_engine, smollm2, draft_runner)
    sampled = [("sampled", lookup_prompt(corpus_ids, np.random.default_rng(9), 90),
                dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=5, logprobs=2))]
    with CompileCounter() as compiles:
        spec = run(engine, work + sampled, stop)
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"
    check_same(base, {rid: ev for rid, ev in spec.items() if rid != "sampled"})
    got = [t for ev in spec["sampled"] for t in ev.token_ids]
    assert len(got) == 24 and spec["sampled"][-1].finish_reason == "length"
    assert len([lp for ev in spec["sampled"] for lp in ev.logprobs]) == 24
    stats = engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    assert sum(stats.acceptance_counts[1:]) > 0, stats   # some rows kept drafts
    finals = [ev[-1].usage for ev in spec.values()]
    assert sum(u.num_draft_tokens for u in finals if u) == stats.num_draft_tokens
    assert sum(u.num_accepted_tokens for u in finals if u) == stats.num_accepted_tokens
    assert engine.draft is not None and engine.draft.num_calls > 0


def test_abort_mid_verification_frees_both_caches(warm_engine, smollm2, corpus_ids,
                                                  draft_runner) -> None:
    engine = draft_engine(warm_engine, smollm2, draft_runner)
    progress = engine.scheduler.draft_progress
    assert progress is not None
    rng = np.random.default_rng(3)
    engine.add(request("a", lookup_prompt(corpus_ids, rng, 160), max_tokens=200,
                       ignore_eos=True))
    engine.add(request("b", lookup_prompt(corpus_ids, rng, 100), max_tokens=30,
                       ignore_eos=True))
    step_until_verifying(engine, "a")
    state = engine.scheduler.request_state("a")
    assert engine.scheduler.kv_cache.num_tokens("a") > state.num_computed_tokens  # drafts
    assert progress.computed("a") > state.num_computed_tokens   # the draft ran ahead
    assert engine.abort("a")
    engine.scheduler.check_integrity()
    assert "a" not in engine.scheduler.kv_cache and progress.computed("a") == 0
    events = []
    while engine.has_work():
        events += engine.step()
        engine.scheduler.check_integrity()
    assert [ev.finish_reason for ev in events if ev.finished] == ["abort", "length"]
    assert engine.scheduler.kv_cache.usage().num_used_blocks == 0
    assert progress.computed("b") == 0
