"""Speculative decoding (n-gram prompt lookup) on SmolLM2: outputs token for token those of
the engine without it, greedy and seeded sampling alike, with stop strings, max_tokens and
logprobs; KV integrity after every step, abort mid-verification, no compile after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from tests.serving.engine.conftest import new_engine, prompt, request, step_until_verifying
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.serving.speculative import SpeculativeConfig
from xlaserve.serving.types import EngineEvent

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)


def lookup_prompt(corpus: list[int], rng: np.random.Generator, n: int) -> list[int]:
    """A text, a newline, then its first quarter again: the model goes on copying it."""
    text = prompt(corpus, rng, n)
    return text + corpus[:1] + text[: n // 4]


def workload(corpus: list[int], **sampling) -> list[tuple[str, list[int], dict]]:
    rng = np.random.default_rng(15)
    out = [(f"look{i}", lookup_prompt(corpus, rng, int(n)), dict(max_tokens=m, **sampling))
           for i, (n, m) in enumerate([(160, 48), (96, 40), (240, 33)])]
    out.append(("plain", prompt(corpus, rng, 50), dict(max_tokens=24, **sampling)))
    out.append(("logprobs", lookup_prompt(corpus, rng, 120),
                dict(max_tokens=20, logprobs=3, **sampling)))
    out.append(("short", lookup_prompt(corpus, rng, 80), dict(max_tokens=3, **sampling)))
    return out


def run(engine: LLMEngine, work: list[tuple[str, list[int], dict]],
        stop: dict[str, tuple[str, ...]] | None = None) -> dict[str, list[EngineEvent]]:
    """Every request at once, to the end; the scheduler's integrity checked after each step."""
    for rid, ids, sampling in work:
        engine.add(request(rid, ids, stop=(stop or {}).get(rid, ()), ignore_eos=True,
                           **sampling))
    out: dict[str, list[EngineEvent]] = {}
    while engine.has_work():
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev)
        engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache.usage().num_used_blocks == 0
    return out


def summary(events: list[EngineEvent]) -> tuple:
    """Tokens, text, finish reason and usage (its draft counters aside: speculation's own)."""
    usage = events[-1].usage
    assert usage is not None
    return ([t for ev in events for t in ev.token_ids], "".join(ev.text for ev in events),
            events[-1].finish_reason,
            (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens))


def check_same(base: dict[str, list[EngineEvent]], spec: dict[str, list[EngineEvent]]) -> None:
    assert base.keys() == spec.keys()
    for rid in base:
        assert summary(spec[rid]) == summary(base[rid]), rid
        lb = [lp for ev in base[rid] for lp in ev.logprobs]
        ls = [lp for ev in spec[rid] for lp in ev.logprobs]
        assert [lp.token_id for lp in ls] == [lp.token_id for lp in lb]
        for a, b in zip(ls, lb):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_greedy_output_identical_and_nothing_compiles(warm_engine, smollm2, corpus_ids) -> None:
    work = workload(corpus_ids, temperature=0.0)
    stop = {"look1": ("\n",)}   # it copies code: a line ends soon
    base = run(new_engine(warm_engine, smollm2), work, stop)
    engine = new_engine(warm_engine, smollm2, speculative=SPEC)
    with CompileCounter() as compiles:
        spec = run(engine, work, stop)
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"
    check_same(base, spec)
    stats = engine.scheduler.spec_stats
    # the copying prompts accept most drafts: fewer steps, several tokens per event
    assert stats.num_drafts > 0 and stats.mean_acceptance_length > 2.0, stats
    assert max(len(ev.token_ids) for ev in spec["look0"]) > 1
    assert engine.num_steps < 0.7 * sum(len(summary(v)[0]) for v in base.values())
    assert len(summary(base["short"])[0]) == 3 and summary(base["look1"])[2] == "stop"


def test_seeded_sampling_identical(warm_engine, smollm2, corpus_ids) -> None:
    """An n-gram draft is a point mass: accepting it iff the target's own draw (same seed,
    same token index) equals it is standard speculative sampling, so seeded requests give the
    very tokens they give without speculation."""
    work = workload(corpus_ids, temperature=0.8, top_p=0.95)
    work = [(rid, ids, {**s, "seed": 1000 + i}) for i, (rid, ids, s) in enumerate(work)]
    base = run(new_engine(warm_engine, smollm2), work)
    engine = new_engine(warm_engine, smollm2, speculative=SPEC)
    spec = run(engine, work)
    check_same(base, spec)
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_abort_mid_verification_frees_every_block(warm_engine, smollm2, corpus_ids) -> None:
    engine = new_engine(warm_engine, smollm2, speculative=SPEC)
    rng = np.random.default_rng(3)
    engine.add(request("a", lookup_prompt(corpus_ids, rng, 160), max_tokens=200,
                       ignore_eos=True))
    engine.add(request("b", lookup_prompt(corpus_ids, rng, 100), max_tokens=30,
                       ignore_eos=True))
    step_until_verifying(engine, "a")
    held = engine.scheduler.kv_cache.num_tokens("a")
    # KV slots reserved for the drafts
    assert held > engine.scheduler.request_state("a").num_computed_tokens
    assert engine.abort("a")
    engine.scheduler.check_integrity()
    assert "a" not in engine.scheduler.kv_cache
    events = []
    while engine.has_work():
        events += engine.step()
        engine.scheduler.check_integrity()
    assert [ev.finish_reason for ev in events if ev.request_id == "a"] == ["abort"]
    assert [ev.finish_reason for ev in events if ev.finished] == ["abort", "length"]
    assert engine.scheduler.kv_cache.usage().num_used_blocks == 0


def test_failed_verify_step_errors_its_request_and_serves_the_next(
        warm_engine, smollm2, corpus_ids, monkeypatch) -> None:
    """The first verify step's results are lost on device: its request ends with "error",
    every block (the drafts' KV slots too) is freed, and a request after it is served with
    drafts."""
    from tests.serving.engine.test_step_failure import run_with_recovery

    engine = new_engine(warm_engine, smollm2, speculative=SPEC)
    real, lost = engine.runner.sample, []

    def sample(call, masks=None):
        result = real(call, masks)
        if not lost and any(len(rows) > 1 for rows in call.sample_rows):   # a verify row
            lost.append(len(call.sample_rows))
            result.out.tokens.delete()     # reading it back raises, as a failed step would
        return result

    monkeypatch.setattr(engine.runner, "sample", sample)
    rng = np.random.default_rng(5)
    engine.add(request("a", lookup_prompt(corpus_ids, rng, 120), max_tokens=24,
                       ignore_eos=True))
    out = run_with_recovery(engine)
    assert lost and out["a"][-1].finish_reason == "error"
    assert engine.scheduler.kv_cache.usage().num_used_blocks == 0
    drafts = engine.scheduler.spec_stats.num_drafts
    engine.add(request("b", lookup_prompt(corpus_ids, rng, 120), max_tokens=24,
                       ignore_eos=True))
    done: list[EngineEvent] = []
    while engine.has_work():
        done += engine.step()
        engine.scheduler.check_integrity()
    assert done[-1].finish_reason == "length" and sum(len(e.token_ids) for e in done) == 24
    assert engine.scheduler.spec_stats.num_drafts > drafts
