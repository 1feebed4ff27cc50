"""Host-only pieces with a fake clock: token buckets and quotas, trace context."""

from __future__ import annotations

import pytest

from tests.serving.fake_clock import Clock
from xlaserve.serving.gateway.ratelimit import RateLimited, RateLimiter
from xlaserve.serving.gateway.tracing import TraceContext
from xlaserve.serving.server_config import TierLimits
from xlaserve.serving.types import Tier


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
