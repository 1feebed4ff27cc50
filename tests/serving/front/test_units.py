"""Host-only pieces with a fake clock: token buckets and quotas, trace context, admission
estimates and bounds."""

from __future__ import annotations

import asyncio
import time

import pytest

from xlaserve.serving.admission import AdmissionController, Rejected
from xlaserve.serving.gateway.ratelimit import RateLimited, RateLimiter
from xlaserve.serving.gateway.tracing import TraceContext
from xlaserve.serving.server_config import AdmissionConfig, TierLimits
from xlaserve.serving.types import Tier


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_debt_and_refill():
    clock = Clock()
    wall = Clock()
    wall.t = 86400 * 100 + 3600.0  # 01:00 UTC
    lim = RateLimiter(lambda tier: TierLimits(tokens_per_minute=600, tokens_per_day=1500),
                      clock, wall)
    lim.check("a", Tier.FREE)
    lim.settle(lim.reserve("a", Tier.FREE, 900), 900)   # 300 into debt: refused until refilled
    with pytest.raises(RateLimited) as e:
        lim.check("a", Tier.FREE)
    assert e.value.code == "rate_limit_exceeded"
    assert e.value.retry_after == pytest.approx(30.1, abs=0.01)  # 301 tokens at 10/s
    clock.t += 31
    h = lim.check("a", Tier.FREE)
    assert h["x-ratelimit-remaining-tokens-day"] == "600"
    lim.settle(lim.reserve("a", Tier.FREE, 600), 600)   # day total 1500: quota used up
    clock.t += 3600
    with pytest.raises(RateLimited) as e:
        lim.check("a", Tier.FREE)
    assert e.value.code == "daily_quota_exceeded"
    assert e.value.retry_after == pytest.approx(23 * 3600)
    wall.t += 23 * 3600                      # next UTC day: quota resets
    lim.check("a", Tier.FREE)
    lim.check("b", Tier.FREE)                # other tenants never shared a bucket


def test_reservations_bound_concurrent_requests():
    """Tokens held by requests in flight count as used: however many arrive together, the
    quota is overshot by at most the last admitted request's own size."""
    clock, wall = Clock(), Clock()
    lim = RateLimiter(lambda tier: TierLimits(tokens_per_minute=600, tokens_per_day=50),
                      clock, wall)
    first = lim.reserve("a", Tier.FREE, 30)             # 0 used: admitted
    second = lim.reserve("a", Tier.FREE, 30)            # 30 held < 50: admitted
    for _ in range(10):                                 # 60 held: everyone else waits
        with pytest.raises(RateLimited) as e:
            lim.reserve("a", Tier.FREE, 30)
        assert e.value.code == "daily_quota_exceeded"
        assert "60 held by requests in flight" in str(e.value)
        with pytest.raises(RateLimited):
            lim.check("a", Tier.FREE)
    assert lim.headers("a", Tier.FREE)["x-ratelimit-remaining-tokens-day"] == "0"
    lim.settle(first, 12)         # served 12 of 30: 18 go back to the bucket and the quota
    assert lim.headers("a", Tier.FREE)["x-ratelimit-remaining-tokens-day"] == "8"
    assert lim.headers("a", Tier.FREE)["x-ratelimit-remaining-tokens"] == "558"
    lim.settle(second, 0)         # failed by the server: nothing charged
    lim.settle(second, 30)        # idempotent: a second settle changes nothing
    assert lim.headers("a", Tier.FREE)["x-ratelimit-remaining-tokens-day"] == "38"
    assert lim.headers("a", Tier.FREE)["x-ratelimit-remaining-tokens"] == "588"
    with pytest.raises(ValueError, match=r"tokens used \(31\) must be within the 30"):
        lim.settle(lim.reserve("a", Tier.FREE, 30), 31)


def test_reservation_refund_caps_at_bucket_capacity():
    """Settling refunds what was held but not used, as if only the usage had been taken at
    the start: the refill in between is capped at the capacity at the same point."""
    clock = Clock()
    lim = RateLimiter(lambda tier: TierLimits(tokens_per_minute=600), clock)
    r = lim.reserve("a", Tier.FREE, 500)               # 600 -> 100
    clock.t += 45                                       # +450 at 10/s -> 550
    lim.settle(r, 100)                                  # 550 + 400 capped: 600 (500 + 450)
    assert lim.headers("a", Tier.FREE)["x-ratelimit-remaining-tokens"] == "600"
    r = lim.reserve("a", Tier.FREE, 500)               # 600 -> 100
    clock.t += 10                                       # -> 200
    lim.settle(r, 300)                                  # 600 - 300 + 100 refill = 400
    assert lim.headers("a", Tier.FREE)["x-ratelimit-remaining-tokens"] == "400"


def test_trace_context():
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    t = TraceContext.from_headers("my-id", tp)
    assert (t.request_id, t.trace_id, t.traceparent) == (
        "my-id", "4bf92f3577b34da6a3ce929d0e0e4736", tp)
    for bad in ("garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", None):
        t = TraceContext.from_headers("bad id with spaces", bad)
        assert t.request_id.startswith("req-") and len(t.trace_id) == 32
        assert t.traceparent.split("-")[1] == t.trace_id


def test_admission_estimate_slo_and_timeout():
    clock = Clock()

    async def scenario() -> None:
        cfg = AdmissionConfig(slo_wait_s={"free": 2.0, "paid": 10.0}, initial_service_rate=1.0,
                              max_queue_wait_s=0.2)
        adm = AdmissionController(cfg, capacity=1, max_queue=10, clock=clock)
        t = await adm.acquire(Tier.FREE)
        assert adm.expected_wait(Tier.FREE) == 1.0   # 1 ahead-or-new / 1 per s
        waiters = [asyncio.create_task(adm.acquire(Tier.FREE)) for _ in range(2)]
        await asyncio.sleep(0)
        # 2 queued: a third free request would wait 3 s > 2 s SLO; a paid one 1 s
        with pytest.raises(Rejected) as e:
            await adm.acquire(Tier.FREE)
        assert e.value.reason == "slo" and e.value.retry_after == 1
        assert adm.expected_wait(Tier.PAID) == 1.0
        # measured service time 0.5 s per request -> rate 2/s, the estimate halves
        clock.t += 0.5
        adm.release(t)
        await asyncio.sleep(0)
        assert adm.service_rate() == 2.0
        # the queued ones time out after max_queue_wait_s (never an unbounded wait)
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert isinstance(results[1], Rejected) and results[1].reason == "timeout"
        adm.release(results[0])
        assert adm.running == 0 and adm.waiting == 0
        assert adm.rejections == {"slo": 1, "timeout": 1}

    asyncio.run(scenario())


def test_admission_weights_in_order():
    async def scenario() -> list[str]:
        cfg = AdmissionConfig(slo_wait_s={"free": 100.0})
        adm = AdmissionController(cfg, capacity=2, max_queue=10)
        order: list[str] = []
        big = await adm.acquire(Tier.FREE, weight=3)  # heavier than capacity: runs alone
        assert adm.running == 3

        async def one(name: str, weight: int) -> None:
            t = await adm.acquire(Tier.FREE, weight=weight)
            order.append(name)
            await asyncio.sleep(0.05)
            adm.release(t)

        a = asyncio.create_task(one("two", 2))
        await asyncio.sleep(0)
        b = asyncio.create_task(one("one", 1))
        await asyncio.sleep(0)
        assert adm.waiting == 2 and adm.expected_wait(Tier.FREE) > 0
        adm.release(big)
        await asyncio.sleep(0.003)  # "two" wakes and holds its slots for 50 ms
        assert order == ["two"] and adm.running == 2  # "one" waits behind, no overtaking
        await asyncio.gather(a, b)
        assert order == ["two", "one"] and adm.running == 0
        return order

    asyncio.run(scenario())


def test_admission_grant_racing_the_queue_timeout_admits():
    """The queue-wait timer and the release() that grants the slot fire in the same loop
    iteration (a busy loop): the waiter is admitted, and no slot is left held."""
    async def scenario() -> None:
        cfg = AdmissionConfig(slo_wait_s={"free": 100.0}, max_queue_wait_s=0.05)
        adm = AdmissionController(cfg, capacity=1, max_queue=4)
        first = await adm.acquire(Tier.FREE)
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, time.sleep, 0.2)     # both timers below come due together
        loop.call_later(0.06, adm.release, first)
        second = await adm.acquire(Tier.FREE)      # was: Rejected("timeout"), slot leaked
        assert adm.running == 1 and adm.rejections == {}
        adm.release(second)
        assert adm.running == 0 and adm.waiting == 0
        await asyncio.wait_for(adm.acquire(Tier.FREE), 1.0)   # idle: admitted at once
        assert adm.running == 1

    asyncio.run(scenario())


def test_admission_grant_racing_a_cancel_frees_the_slot_unmeasured():
    """A queued caller cancelled in the instant its slot is granted hands the slot on, and its
    zero time in the engine does not enter the service-time average."""
    clock = Clock()

    async def scenario() -> None:
        cfg = AdmissionConfig(slo_wait_s={"free": 100.0})
        adm = AdmissionController(cfg, capacity=1, max_queue=4, clock=clock)
        first = await adm.acquire(Tier.FREE)
        waiter = asyncio.create_task(adm.acquire(Tier.FREE))
        await asyncio.sleep(0)
        assert adm.waiting == 1
        clock.t += 2.0
        waiter.cancel()             # its client goes away ...
        adm.release(first)          # ... as the slot is granted, before the waiter runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.running == 0 and adm.waiting == 0
        assert adm.service_rate() == 0.5   # 1 slot / 2.0 s measured; was 1 / 1.6 s

    asyncio.run(scenario())


def test_admission_without_a_queue_rejects_when_full():
    async def scenario() -> None:
        adm = AdmissionController(AdmissionConfig(slo_wait_s={"free": 100.0}), capacity=1,
                                  max_queue=0)
        t = await adm.acquire(Tier.FREE)
        with pytest.raises(Rejected) as e:
            await adm.acquire(Tier.FREE)
        assert e.value.reason == "queue_full" and e.value.retry_after >= 1
        assert "admission queue is full (0 waiting)" in str(e.value)
        adm.release(t)
        assert adm.running == 0
        await adm.acquire(Tier.FREE)

    asyncio.run(scenario())
