"""Admission order: tier, then priority, then deadline, then arrival; aging lifts tiers."""

from __future__ import annotations

from collections.abc import Callable

from tests.serving.scheduler.scheduler_helpers import req, rows, step

from xlaserve.serving.scheduler import Scheduler, effective_tier
from xlaserve.serving.scheduler.sequence import Sequence
from xlaserve.serving.types import Tier


def test_admission_order_tier_priority_deadline_arrival(make: Callable[..., Scheduler]) -> None:
    s = make()
    s.add(req("f1", 2, arrival=0.0))
    s.add(req("p1", 2, tier=Tier.PAID, arrival=1.0))
    s.add(req("p2", 2, tier=Tier.PAID, priority=3, arrival=2.0))
    s.add(req("p3", 2, tier=Tier.PAID, deadline=50.0, arrival=3.0))
    s.add(req("p4", 2, tier=Tier.PAID, deadline=40.0, arrival=4.0))
    s.add(req("i1", 2, tier=Tier.INTERNAL, arrival=5.0))
    s.add(req("p5", 2, tier=Tier.PAID, arrival=1.0))        # ties p1 up to arrival: add order
    p = step(s, now=5.0)
    assert [r[0] for r in rows(p)] == ["i1", "p2", "p4", "p3", "p1", "p5", "f1"]


def test_max_num_seqs_and_budget_limit_admission(make: Callable[..., Scheduler]) -> None:
    s = make(max_num_seqs=2, max_num_batched_tokens=10)
    for i in range(4):
        s.add(req(f"r{i}", 4, arrival=float(i)))
    assert rows(step(s)) == [("r0", 0, 4, True), ("r1", 0, 4, True)]
    assert (s.num_running, s.num_waiting) == (2, 2)
    s.finish("r0", "stop")
    assert rows(step(s)) == [("r1", 4, 1, True), ("r2", 0, 4, True)]


def test_effective_tier_is_exact() -> None:
    seq = Sequence.from_request(req("f", 2, arrival=10.0), 0)
    assert [effective_tier(seq, now, 5.0) for now in (9.0, 10.0, 14.999, 15.0, 30.0)] == [
        0, 0, 0, 1, 4]
    assert effective_tier(seq, 1e9, float("inf")) == 0


def run_stream(make: Callable[..., Scheduler], aging: float, steps: int) -> list[str]:
    """A FREE request at t=0, then one new PAID request each second; one slot per step."""
    s = make(max_num_seqs=1, max_num_batched_tokens=8, aging_seconds=aging)
    s.add(req("free", 4, max_tokens=1, arrival=0.0))
    served = []
    for t in range(steps):
        s.add(req(f"paid{t}", 4, max_tokens=1, tier=Tier.PAID, arrival=float(t)))
        p = step(s, now=float(t))                   # max_tokens=1: each finishes in its step
        served += [r.request_id for r in p.rows]
    for rid in ["free", *(f"paid{i}" for i in range(steps))]:
        s.abort(rid)                                # None for those already finished
    return served


def test_aging_lets_free_request_overtake_newer_paid(make: Callable[..., Scheduler]) -> None:
    # t=5: free has aged one tier (FREE+1 == PAID) and arrived before paid5: it runs.
    assert run_stream(make, aging=5.0, steps=8) == [
        "paid0", "paid1", "paid2", "paid3", "paid4", "free", "paid5", "paid6"]
    # Without aging it starves behind the stream.
    assert "free" not in run_stream(make, aging=float("inf"), steps=30)


def test_aging_crosses_two_tiers(make: Callable[..., Scheduler]) -> None:
    s = make(aging_seconds=10.0)
    s.add(req("free", 2, arrival=0.0))
    s.add(req("internal", 2, tier=Tier.INTERNAL, arrival=19.0))
    s.add(req("paid", 2, tier=Tier.PAID, arrival=0.0))
    # now=20: free is 0+2 = 2, internal 2+0 = 2 (later arrival), paid 1+2 = 3.
    assert [r[0] for r in rows(step(s, now=20.0))] == ["paid", "free", "internal"]
