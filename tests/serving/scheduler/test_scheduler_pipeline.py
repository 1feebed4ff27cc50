"""Pipelined scheduling: PENDING_TOKEN placeholders, in-order updates, both modes agree."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.serving.scheduler.scheduler_helpers import req, rows, samples, token_for
from xlaserve.serving.scheduler import PENDING_TOKEN, Scheduler, StepPlan
from xlaserve.serving.types import Tier


def test_one_step_ahead_placeholders(make: Callable[..., Scheduler]) -> None:
    s = make()
    s.add(req("A", 5))
    p0 = s.schedule(0.0)
    assert rows(p0) == [("A", 0, 5, True)]
    p1 = s.schedule(0.0)                                   # step 0's sample not known yet
    assert rows(p1) == [("A", 5, 1, True)]
    assert p1.decodes[0].token_ids == (PENDING_TOKEN,)
    assert p1.decodes[0].slot_mapping == (2 * 4 + 1,)      # position 5 in block 2
    assert s.request_state("A").output_token_ids == (PENDING_TOKEN, PENDING_TOKEN)
    assert s.update(p0, {"A": 42}) == {"A": (42,)}
    p2 = s.schedule(0.0)
    assert rows(p2) == [("A", 6, 1, True)] and p2.decodes[0].token_ids == (PENDING_TOKEN,)
    assert s.update(p1, {"A": 7}) == {"A": (7,)}
    assert s.update(p2, {"A": 8}) == {"A": (8,)}
    assert s.request_state("A").output_token_ids == (42, 7, 8)
    p3 = s.schedule(0.0)                                   # alternating again: real token
    assert p3.decodes[0].token_ids == (8,)
    s.update(p3, {"A": 9})
    s.check_integrity()
    s.abort("A")


def test_updates_must_come_in_order_and_match_rows(make: Callable[..., Scheduler]) -> None:
    s = make()
    s.add(req("A", 5))
    p0 = s.schedule(0.0)
    p1 = s.schedule(0.0)
    with pytest.raises(ValueError, match="update for step 1, expected step 0"):
        s.update(p1, {"A": 1})
    with pytest.raises(ValueError, match="missing for \\['A'\\]"):
        s.update(p0, {})
    with pytest.raises(ValueError, match="non-sampling rows \\['Z'\\]"):
        s.update(p0, {"A": 1, "Z": 2})
    with pytest.raises(ValueError, match="negative {'A': -1}"):
        s.update(p0, {"A": -1})
    s.update(p0, {"A": 1})
    with pytest.raises(ValueError, match="update for step 0, expected step 1"):
        s.update(p0, {"A": 1})
    s.update(p1, {"A": 2})
    assert s.update(StepPlan(99), {}) == {}
    s.check_integrity()
    s.abort("A")


def test_finish_in_step_n_while_scheduled_in_n_plus_1(make: Callable[..., Scheduler]) -> None:
    s = make()
    s.add(req("A", 5))
    s.add(req("B", 6))
    p0 = s.schedule(0.0)
    p1 = s.schedule(0.0)
    assert [r.request_id for r in p1.decodes] == ["A", "B"]
    assert s.update(p0, {"A": 2, "B": 3}) == {"A": (2,), "B": (3,)}
    s.finish("A", "stop")                                  # A sampled eos in step 0
    assert s.stats().kv_cache.num_used_blocks == 2         # only B's blocks are held
    assert s.kv_cache.request_ids() == {"B"}
    assert s.update(p1, {"A": 9, "B": 4}) == {"B": (4,)}    # A's extra row is discarded
    p2 = s.schedule(0.0)
    assert rows(p2) == [("B", 7, 1, True)]
    s.update(p2, {"B": 5})
    s.check_integrity()
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("B", 3))
    s.abort("B")


def test_preempted_with_placeholder_waits_for_update(make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=5)                               # 4 usable blocks
    s.add(req("A", 7, max_tokens=4, tier=Tier.PAID))
    s.add(req("B", list(range(50, 57)), max_tokens=4))
    p0 = s.schedule(0.0)                                   # both sample position 7
    p1 = s.schedule(0.0)                                   # both decode position 7
    p2 = s.schedule(0.0)                                   # A needs a block: B preempted
    assert p2.preempted == ("B",) and rows(p2) == [("A", 8, 1, True)]
    assert s.request_state("B").output_token_ids == (PENDING_TOKEN, PENDING_TOKEN)
    s.finish("A", "stop")                                  # room again, but B's tokens unknown
    assert s.schedule(0.0).is_empty
    s.update(p0, samples(p0))
    assert s.schedule(0.0).is_empty                        # still one placeholder
    s.update(p1, samples(p1))
    s.update(p2, samples(p2))
    p = s.schedule(0.0)
    # Recompute 7 prompt + 2 generated tokens; the first block hits (only blocks of known
    # tokens were registered when B was preempted: positions 0..6 of 8 computed).
    assert rows(p) == [("B", 4, 5, True)]
    assert p.prefills[0].token_ids[3:] == (token_for("B", 7), token_for("B", 8))
    s.update(p, samples(p))
    s.check_integrity()
    s.abort("B")


def test_drop_in_flight_after_a_failed_step(make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=5)                               # 4 usable blocks
    s.add(req("A", 7, max_tokens=4, tier=Tier.PAID))
    s.add(req("B", list(range(50, 57)), max_tokens=4))
    p0 = s.schedule(0.0)
    s.schedule(0.0)
    assert s.schedule(0.0).preempted == ("B",)             # B waits with two placeholders
    s.add(req("C", 3, max_tokens=4))                       # waiting, never scheduled
    # The step's results never come back: the engine ends the running request ...
    with pytest.raises(ValueError, match=r"running requests \['A'\]: finish them first"):
        s.drop_in_flight()
    s.finish("A", "error")
    s.drop_in_flight()                                     # ... and drops the plans
    s.check_integrity()
    assert s.request_state("B").output_token_ids == ()
    with pytest.raises(ValueError, match="expected step None"):
        s.update(p0, samples(p0))
    s.kv_cache.pool.forget_hashes()                        # the device KV is gone too
    p = s.schedule(0.0)                                    # B prefills its prompt again
    assert sorted(rows(p)) == [("B", 0, 7, True), ("C", 0, 3, True)]
    assert s.update(p, samples(p)) == {rid: (t,) for rid, t in samples(p).items()}
    s.check_integrity()
    s.abort("B")
    s.abort("C")


def drive(s: Scheduler, ahead: bool, max_steps: int = 500) -> dict[str, list[int]]:
    """Run to completion; `ahead`: schedule n+1 before updating n. Returns emitted tokens."""
    out: dict[str, list[int]] = {}
    pending: list[StepPlan] = []

    def resolve(plan: StepPlan) -> None:
        for rid, (tok,) in s.update(plan, samples(plan)).items():
            out.setdefault(rid, []).append(tok)
            if tok % 7 == 0:                               # the fake model's "eos"
                s.finish(rid, "stop")
            elif s.length_finish_reason(rid):
                s.finish(rid, "length")

    for _ in range(max_steps):
        if not s.has_unfinished and not pending:
            break
        pending.append(s.schedule(0.0))
        while len(pending) > (1 if ahead else 0):
            resolve(pending.pop(0))
        s.check_integrity()
    for plan in pending:
        resolve(plan)
    assert not s.has_unfinished
    return out


@pytest.mark.parametrize("ahead", [False, True])
def test_both_modes_emit_every_token_once(make: Callable[..., Scheduler], ahead: bool) -> None:
    s = make(num_kv_blocks=9, max_num_batched_tokens=12, max_prefill_chunk=5)
    lengths = {f"r{i}": 4 + 2 * i for i in range(6)}
    for i, (rid, n) in enumerate(lengths.items()):
        s.add(req(rid, list(range(10 * i, 10 * i + n)), max_tokens=7, arrival=float(i),
                  tier=Tier.PAID if i % 3 == 0 else Tier.FREE))
    out = drive(s, ahead)
    for rid, n in lengths.items():
        expected = []
        for pos in range(n, n + 7):
            expected.append(token_for(rid, pos))
            if expected[-1] % 7 == 0:
                break
        assert out[rid] == expected, rid
    assert s.stats().num_preemptions > 0
    usage = s.stats().kv_cache
    assert usage.num_used_blocks == 0
    assert usage.num_free_blocks + usage.num_cached_free_blocks == 8
