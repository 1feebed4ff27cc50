"""Prefix sharing through the scheduler: one copy of a shared system prompt, tenant salts."""

from __future__ import annotations

from collections.abc import Callable

from tests.serving.scheduler.scheduler_helpers import req, rows, step

from xlaserve.serving.scheduler import Scheduler

SYSTEM = list(range(1, 513))                       # 512 tokens = 32 blocks of 16


def test_shared_system_prompt_held_once(make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=65, block_size=16, max_num_seqs=16, max_num_batched_tokens=520,
             max_prefill_chunk=520, max_model_len=1024)
    for i in range(16):
        s.add(req(f"r{i}", SYSTEM + [2000 + i] * 8, max_tokens=4, arrival=float(i)))
    assert rows(step(s)) == [("r0", 0, 520, True)]  # the budget admits one full prompt
    p = step(s)                                     # r0's blocks are registered: 15 hits
    assert rows(p) == [("r0", 520, 1, True)] + [(f"r{i}", 512, 8, True) for i in range(1, 16)]
    usage = s.stats().kv_cache
    assert usage.num_used_blocks == 33 + 15         # 32 shared + r0's tail + one tail each
    table = p.decodes[0].block_table
    assert all(r.block_table[:32] == table[:32] for r in p.rows)
    assert all(s.kv_cache.pool.ref_count(b) == 16 for b in table[:32])
    assert s.stats().prefix_hit_rate == 15 * 512 / (16 * 520)
    assert s.request_state("r3").num_cached_tokens == 512
    assert s.request_state("r0").num_cached_tokens == 0
    while s.has_unfinished:
        step(s)
    usage = s.stats().kv_cache
    assert usage.num_used_blocks == 0 and usage.num_cached_free_blocks >= 32


def test_tenant_salt_prevents_sharing(make: Callable[..., Scheduler]) -> None:
    s = make(block_size=16, num_kv_blocks=80, max_num_batched_tokens=520,
             max_prefill_chunk=520, max_model_len=1024)
    s.add(req("acme1", SYSTEM + [7], tenant="acme", max_tokens=2))
    step(s)
    s.add(req("globex", SYSTEM + [7], tenant="globex", max_tokens=2))
    s.add(req("acme2", SYSTEM + [8], tenant="acme", max_tokens=2))
    p = step(s)
    # globex recomputes everything; acme2 hits all 32 blocks and is a one-token (decode) row.
    assert rows(p) == [("acme1", 513, 1, True), ("acme2", 512, 1, True), ("globex", 0, 513, True)]
    assert p.prefills[0].block_table[:32] != p.decodes[0].block_table[:32]
    assert p.decodes[1].block_table[:32] == p.decodes[0].block_table[:32]
    assert s.request_state("acme2").num_cached_tokens == 512
    assert s.request_state("globex").num_cached_tokens == 0
    for rid in ("acme2", "globex"):
        s.abort(rid)


def test_requests_arriving_together_compute_the_shared_prefix_once(
        make: Callable[..., Scheduler]) -> None:
    """Like n > 1 completions of one prompt: all added before any step, with a budget that
    would admit them all at once. The first computes the prefix; the others wait one step for
    its blocks instead of computing their own copies, and an unrelated request is not held."""
    s = make(num_kv_blocks=80, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096,
             max_prefill_chunk=512, max_model_len=1024)
    for i in range(4):
        s.add(req(f"n{i}", SYSTEM + [7] * 8, max_tokens=4))
    s.add(req("other", 40, max_tokens=4, arrival=1.0))
    assert rows(step(s)) == [("n0", 0, 512, False), ("other", 0, 40, True)]
    assert s.num_waiting == 3                        # n0's block 32 (tokens 512-519) to come
    p = step(s)
    assert rows(p) == [("other", 40, 1, True), ("n0", 512, 8, True),
                       ("n1", 512, 8, True), ("n2", 512, 8, True), ("n3", 512, 8, True)]
    table = p.prefills[0].block_table
    assert all(r.block_table[:32] == table[:32] for r in p.prefills)
    assert all(s.kv_cache.pool.ref_count(b) == 4 for b in table[:32])
    assert s.stats().kv_cache.num_used_blocks == 32 + 4 + 3   # prefix once, 4 tails, other
    assert [s.request_state(f"n{i}").num_cached_tokens for i in range(4)] == [0, 512, 512, 512]
    while s.has_unfinished:
        step(s)


def test_waiting_on_a_prefix_block_ends_when_its_computer_is_preempted(
        make: Callable[..., Scheduler]) -> None:
    """The wait is recomputed every step from the running requests: if the one computing the
    shared block leaves (here: aborted mid-prefill), the next waiter computes it itself."""
    s = make(num_kv_blocks=80, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096,
             max_prefill_chunk=256, max_model_len=1024)
    s.add(req("a", SYSTEM + [1], max_tokens=2))
    s.add(req("b", SYSTEM + [2], max_tokens=2, arrival=1.0))
    assert rows(step(s)) == [("a", 0, 256, False)]
    s.abort("a")
    assert rows(step(s)) == [("b", 256, 256, False)]  # a's first 16 blocks were registered
    assert s.request_state("b").num_cached_tokens == 256
    while s.has_unfinished:
        step(s)
