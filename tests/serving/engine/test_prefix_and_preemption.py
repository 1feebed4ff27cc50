"""Prefix sharing, preemption by recompute and abort, on the real SmolLM2 engine."""

from __future__ import annotations

import time

import numpy as np

from tests.serving.engine.conftest import (collect, new_engine, prompt, request, text_of,
                                           tokens_of)


def _ttft(engine, req) -> float:
    """Seconds from add to the first token of a request run alone."""
    t0 = time.perf_counter()
    engine.add(req)
    first = None
    while engine.has_work():
        for ev in engine.step():
            if ev.token_ids and first is None:
                first = time.perf_counter() - t0
    return first


def test_shared_system_prompt_is_held_once_and_skips_prefill(engine, corpus_ids) -> None:
    rng = np.random.default_rng(16)
    system = prompt(corpus_ids, rng, 512)
    questions = [prompt(corpus_ids, rng, int(n)) for n in rng.integers(8, 40, 17)]
    bs = engine.config.scheduler.block_size
    prefix_blocks = 512 // bs

    # q0 computes the 512-token prefix; once it decodes, 15 more join it and share the prefix.
    engine.add(request("q0", system + questions[0], max_tokens=40, ignore_eos=True))
    while not engine.step():
        pass
    for i in range(1, 16):
        engine.add(request(f"q{i}", system + questions[i], max_tokens=8, ignore_eos=True))
    usage = {}
    together = False
    kv = engine.scheduler.kv_cache
    while engine.has_work():
        for ev in engine.step():
            if ev.usage:
                usage[ev.request_id] = ev.usage
        if engine.scheduler.num_running == 16 and not together:
            together = True
            shared = kv.block_table("q0")[:prefix_blocks]
            for rid in (f"q{i}" for i in range(16)):
                assert kv.block_table(rid)[:prefix_blocks] == shared  # same physical blocks
            assert all(kv.pool.ref_count(b) == 16 for b in shared)
            own = sum(len(kv.block_table(f"q{i}")) - prefix_blocks for i in range(16))
            assert kv.usage().num_used_blocks == prefix_blocks + own  # prefix held once
    engine.scheduler.check_integrity()
    assert together, "the 16 requests never ran together"
    assert usage["q0"].cached_tokens == 0
    assert all(usage[f"q{i}"].cached_tokens == 512 for i in range(1, 16)), usage

    # A prefix hit skips 512 tokens of prefill: measured time to first token drops.
    cold = _ttft(engine, request("cold", prompt(corpus_ids, rng, 512) + questions[16],
                                 max_tokens=1))
    warm = _ttft(engine, request("warm", system + questions[16], max_tokens=1))
    assert warm < cold / 2, (cold, warm)


def test_preemption_recomputes_and_matches(warm_engine, smollm2, corpus_ids) -> None:
    rng = np.random.default_rng(7)
    work = [(prompt(corpus_ids, rng, int(n)), int(m))
            for n, m in zip(rng.integers(17, 32, 8), rng.integers(30, 50, 8))]
    free = new_engine(warm_engine, smollm2)
    for i, (ids, m) in enumerate(work):
        free.add(request(f"p{i}", ids, max_tokens=m, ignore_eos=True))
    expected = {rid: tokens_of(evs) for rid, evs in collect(free).items()}

    # Short prompts are all admitted, then their growth overflows 24 usable blocks (384 tokens).
    tight = new_engine(warm_engine, smollm2, num_kv_blocks=25)
    for i, (ids, m) in enumerate(work):
        tight.add(request(f"p{i}", ids, max_tokens=m, ignore_eos=True))
    got = {rid: tokens_of(evs) for rid, evs in collect(tight).items()}
    assert got == expected
    stats = tight.scheduler.stats()
    assert stats.num_preemptions > 0
    usage = stats.kv_cache
    assert usage.num_used_blocks == 0
    assert usage.num_free_blocks + usage.num_cached_free_blocks == usage.num_total_blocks


def test_abort_in_every_phase_frees_all_blocks(engine, corpus_ids) -> None:
    rng = np.random.default_rng(3)
    kv = engine.scheduler.kv_cache
    long_prompt = prompt(corpus_ids, rng, 700)  # three steps of prefill at chunk 256

    # queued: never scheduled
    engine.add(request("queued", prompt(corpus_ids, rng, 20), max_tokens=5))
    engine.abort("queued")
    events = engine.step()
    assert [e.finish_reason for e in events if e.request_id == "queued"] == ["abort"]
    engine.scheduler.check_integrity()
    assert kv.usage().num_used_blocks == 0

    # mid-prefill: after the first chunk of a long prompt
    engine.add(request("prefill", long_prompt, max_tokens=5))
    engine.step()
    assert kv.usage().num_used_blocks > 0
    engine.abort("prefill")
    list(engine.run_until_done())
    engine.scheduler.check_integrity()
    assert kv.usage().num_used_blocks == 0

    # mid-decode, with another request running beside it
    engine.add(request("decode", prompt(corpus_ids, rng, 30), max_tokens=50, ignore_eos=True))
    engine.add(request("other", prompt(corpus_ids, rng, 30), max_tokens=12, ignore_eos=True))
    emitted = {"decode": 0, "other": 0}
    finish = {}
    while engine.has_work():
        for ev in engine.step():
            emitted[ev.request_id] += len(ev.token_ids)
            if ev.finished:
                finish[ev.request_id] = ev.finish_reason
        if emitted["decode"] == 5 and "decode" not in finish:
            engine.abort("decode")
    assert finish == {"decode": "abort", "other": "length"}
    assert emitted["other"] == 12
    engine.scheduler.check_integrity()
    assert kv.usage().num_used_blocks == 0
    assert not engine.abort("decode")  # already ended


def test_n_completions_share_the_prompt_blocks(engine, corpus_ids) -> None:
    rng = np.random.default_rng(5)
    ids = prompt(corpus_ids, rng, 200)
    for k in range(3):  # as the HTTP layer adds the n choices: together, before any step
        engine.add(request(f"n{k}", ids, max_tokens=6, temperature=1.5, seed=10 + k))
    kv = engine.scheduler.kv_cache
    peak = 0
    out: dict = {}
    while engine.has_work():
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev)
        peak = max(peak, kv.usage().num_used_blocks)
    cached = [out[f"n{k}"][-1].usage.cached_tokens for k in range(3)]
    assert cached == [0, 192, 192]  # n0 computes the 12 full blocks, n1 and n2 reuse them
    assert peak == 13 + 2 * 1       # the prompt held once, plus one tail block per sibling
    assert len({text_of(evs) for evs in out.values()}) > 1
    engine.scheduler.check_integrity()
