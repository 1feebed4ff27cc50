"""Out of blocks: recompute preemption, victim choice, requeue order, nothing lost."""

from __future__ import annotations

from collections.abc import Callable

from tests.serving.scheduler.scheduler_helpers import req, rows, samples, step, token_for
from xlaserve.serving.scheduler import Scheduler
from xlaserve.serving.types import Tier


def prompt(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def test_preempt_latest_then_recompute_hits_own_blocks(make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=5)                            # 4 usable blocks of 4 tokens
    s.add(req("A", prompt(10, 7), max_tokens=4, arrival=0.0))
    s.add(req("B", prompt(20, 7), max_tokens=4, arrival=1.0))
    assert rows(step(s)) == [("A", 0, 7, True), ("B", 0, 7, True)]
    assert rows(step(s)) == [("A", 7, 1, True), ("B", 7, 1, True)]
    s.add(req("D", prompt(30, 3), max_tokens=4, arrival=0.5))          # waits: no block left
    p = step(s)                                          # A needs a third block: B goes
    assert p.preempted == ("B",) and rows(p) == [("A", 8, 1, True)]
    assert p.decodes[0].block_table == (1, 2, 4)         # B's tail block 4, freed first, evicted
    b = s.request_state("B")
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == ("waiting", 0, 1)
    assert b.output_token_ids == (token_for("B", 7), token_for("B", 8))   # kept
    assert s.kv_cache.pool.eviction_order() == (3,)      # B's first block: still cached
    assert s.stats().num_preemptions == 1
    # Nobody fits yet; then requeued B is admitted ahead of D (same tier, D arrived earlier).
    assert rows(step(s)) == [("A", 9, 1, True)]          # A reaches max_tokens=4: finished
    assert "A" not in s
    p = step(s)
    # B recomputes 7 prompt + 2 generated tokens; its first block is a hit (4 tokens).
    assert rows(p) == [("B", 4, 5, True), ("D", 0, 3, True)]
    assert p.prefills[0].block_table[0] == 3
    assert s.request_state("B").num_cached_tokens == 0   # usage counts the first admission
    # ... but the hit rate counts prompts served from others' blocks: B finding its own block
    # again is a readmission hit, not a prefix-cache hit (A, B and D queried once each).
    stats = s.kv_cache.prefix_cache_stats
    assert (stats.num_queries, stats.hit_tokens, stats.readmitted_hit_tokens) == (3, 0, 4)
    step(s)                                              # B samples its 4th token: finished
    assert s.request_state("D").status == "running" and "B" not in s
    s.abort("D")
    usage = s.stats().kv_cache
    assert usage.num_used_blocks == 0
    assert usage.num_free_blocks + usage.num_cached_free_blocks == usage.num_total_blocks


def test_victim_is_lowest_tier_then_latest_arrival(make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=7)                            # 6 usable blocks
    s.add(req("paid", prompt(10, 8), tier=Tier.PAID, arrival=1.0))
    s.add(req("free_old", prompt(20, 8), arrival=0.0))
    s.add(req("free_new", prompt(30, 7), arrival=2.0))
    assert [r[0] for r in rows(step(s))] == ["paid", "free_old", "free_new"]
    p = step(s)          # paid and free_old each need a third block; free_new holds spare room
    assert p.preempted == ("free_new",)
    assert rows(p) == [("paid", 8, 1, True), ("free_old", 8, 1, True)]


def test_requester_preempts_itself_when_lowest(make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=5)
    s.add(req("paid", prompt(10, 7), max_tokens=4, tier=Tier.PAID, arrival=1.0))
    s.add(req("free", prompt(20, 8), max_tokens=4, arrival=0.0))
    step(s)
    p = step(s)                                          # free (ranked last) needs a block
    assert p.preempted == ("free",) and rows(p) == [("paid", 7, 1, True)]


def test_victim_already_scheduled_this_step_is_rolled_back(
        make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=5, max_prefill_chunk=4)       # 4 usable blocks
    s.add(req("free", prompt(10, 3), max_tokens=8, arrival=0.0))
    assert rows(step(s)) == [("free", 0, 3, True)]       # 1 block
    s.add(req("paid", prompt(20, 16), max_tokens=1, tier=Tier.PAID, arrival=1.0))
    assert rows(step(s)) == [("free", 3, 1, True), ("paid", 0, 4, False)]
    assert rows(step(s)) == [("free", 4, 1, True), ("paid", 4, 4, False)]
    # free's decode is planned first (decodes first), then paid's chunk needs a 4th block.
    p = step(s)
    assert p.preempted == ("free",)
    assert rows(p) == [("paid", 8, 4, False)]
    assert p.num_tokens == 4


def test_a_chunk_that_does_not_fit_shrinks_instead_of_preempting(
        make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=5, max_prefill_chunk=8)       # 4 usable blocks of 4 tokens
    s.add(req("old", prompt(10, 2), max_tokens=8, arrival=0.0))
    assert rows(step(s)) == [("old", 0, 2, True)]
    s.add(req("long", prompt(20, 14), max_tokens=2, arrival=1.0))
    assert rows(step(s)) == [("old", 2, 1, True), ("long", 0, 8, False)]   # 1 block left
    # long's next 6 tokens need 2 blocks: it takes the 4 tokens the last block holds rather
    # than preempting (it would have been its own victim: the latest arrival)
    p = step(s)
    assert p.preempted == () and rows(p) == [("old", 3, 1, True), ("long", 8, 4, False)]
    while s.has_unfinished:                              # and everything still completes
        step(s)


def test_everything_completes_under_pressure(make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=9, max_num_batched_tokens=16, max_prefill_chunk=8)
    for i in range(6):
        s.add(req(f"r{i}", prompt(100 * i, 5 + 3 * i), max_tokens=6, arrival=float(i),
                  tier=Tier.PAID if i % 2 else Tier.FREE))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
    for _ in range(200):
        if not s.has_unfinished:
            break
        plan = s.schedule(0.0)
        for rid, (tok,) in s.update(plan, samples(plan)).items():
            outputs[rid].append(tok)
            if s.length_finish_reason(rid):
                s.finish(rid, "length")
        s.check_integrity()
    assert not s.has_unfinished and s.stats().num_preemptions > 0
    for i in range(6):          # every token exactly once, none lost, none re-emitted
        n = 5 + 3 * i
        assert outputs[f"r{i}"] == [token_for(f"r{i}", n + k) for k in range(6)]
    usage = s.stats().kv_cache
    assert usage.num_used_blocks == 0
    assert usage.num_free_blocks + usage.num_cached_free_blocks == 8
