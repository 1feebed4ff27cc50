"""Per-tenant rate limits: a token bucket on requests, a token bucket on tokens (prompt +
completion) and a daily token quota, with limits chosen by the tenant's tier.

    check()    right after authentication, before the body is read (malformed floods count
               too): takes one request from the request bucket; refuses while the tenant's
               token bucket is empty or in debt, or its daily quota is used up
    reserve()  once the request is tokenized: the same refusals, then holds the most it can
               use (prompt tokens + choices x max_tokens): the token bucket is debited (it
               may go into debt) and the amount counts against the daily quota
    settle()   when it ends: the reservation becomes the tokens actually served; the rest
               goes back to the bucket and the quota

Tokens held by requests in flight count as used, so a request is admitted only while the
tenant has something left after everything in flight, and what it then uses cannot exceed its
reservation: a limit is overshot by one request's own size, never by more, however many
arrive together.  Nobody is charged for tokens they did not get.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from xlaserve.serving.server_config import TierLimits
from xlaserve.serving.types import Tier


class RateLimited(Exception):
    """429: the tenant is over a limit; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float, headers: dict[str, str], code: str):
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = headers
        self.code = code


@dataclass
class TokenBucket:
    capacity: float
    rate: float          # refill per second
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def seconds_until(self, amount: float) -> float:
        """Time until the level reaches `amount` (0 if it already has)."""
        return max(0.0, (amount - self.level) / self.rate) if self.rate > 0 else math.inf


@dataclass
class _TenantState:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    day: int
    day_tokens: int       # served today (settled)
    reserved: int = 0     # held by requests in flight (any day)


@dataclass
class Reservation:
    """Tokens held for one request in flight; `RateLimiter.settle` ends it."""
    tenant: str
    tier: Tier
    tokens: int
    settled: bool = False


class RateLimiter:
    def __init__(self, limits: Callable[[Tier], TierLimits],
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self._limits = limits
        self._clock = clock
        self._wall = wall
        self._tenants: dict[tuple[str, Tier], _TenantState] = {}

    def _state(self, tenant: str, tier: Tier) -> tuple[_TenantState, TierLimits]:
        lim = self._limits(tier)
        now, day = self._clock(), int(self._wall() // 86400)
        st = self._tenants.get((tenant, tier))
        if st is None:
            def bucket(per_minute: float) -> TokenBucket | None:
                return TokenBucket(per_minute, per_minute / 60, per_minute, now) \
                    if per_minute > 0 else None
            st = _TenantState(bucket(lim.requests_per_minute), bucket(lim.tokens_per_minute),
                              day, 0)
            self._tenants[(tenant, tier)] = st
        for b in (st.requests, st.tokens):
            if b is not None:
                b.refill(now)
        if st.day != day:
            st.day, st.day_tokens = day, 0
        return st, lim

    def headers(self, tenant: str, tier: Tier) -> dict[str, str]:
        """OpenAI-style x-ratelimit-* headers for the tenant's current state (tokens held by
        requests in flight are not remaining)."""
        st, lim = self._state(tenant, tier)
        h: dict[str, str] = {}
        for kind, b in (("requests", st.requests), ("tokens", st.tokens)):
            if b is not None:
                h[f"x-ratelimit-limit-{kind}"] = str(int(b.capacity))
                h[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(b.level)))
                h[f"x-ratelimit-reset-{kind}"] = f"{b.seconds_until(b.capacity):.3f}s"
        if lim.tokens_per_day:
            h["x-ratelimit-limit-tokens-day"] = str(lim.tokens_per_day)
            h["x-ratelimit-remaining-tokens-day"] = str(max(
                0, lim.tokens_per_day - st.day_tokens - st.reserved))
        return h

    def _refuse_tokens(self, st: _TenantState, lim: TierLimits, tenant: str, tier: Tier
                       ) -> None:
        if lim.tokens_per_day and st.day_tokens + st.reserved >= lim.tokens_per_day:
            wait = 86400 - self._wall() % 86400
            held = f" ({st.reserved} held by requests in flight)" if st.reserved else ""
            raise RateLimited(f"daily token quota of {lim.tokens_per_day} used up for tenant "
                              f"{tenant!r}{held}; it resets at 00:00 UTC", wait,
                              self.headers(tenant, tier), "daily_quota_exceeded")
        if st.tokens is not None and st.tokens.level < 1:
            raise RateLimited(f"token rate limit of {lim.tokens_per_minute:g}/min reached for "
                              f"tenant {tenant!r}", st.tokens.seconds_until(1),
                              self.headers(tenant, tier), "rate_limit_exceeded")

    def check(self, tenant: str, tier: Tier) -> dict[str, str]:
        """Admit one request for `tenant` (taking one from its request bucket) or raise
        RateLimited.  Returns the x-ratelimit-* headers to send."""
        st, lim = self._state(tenant, tier)
        self._refuse_tokens(st, lim, tenant, tier)
        if st.requests is not None:
            if st.requests.level < 1:
                raise RateLimited(f"request rate limit of {lim.requests_per_minute:g}/min "
                                  f"reached for tenant {tenant!r}", st.requests.seconds_until(1),
                                  self.headers(tenant, tier), "rate_limit_exceeded")
            st.requests.level -= 1
        return self.headers(tenant, tier)

    def reserve(self, tenant: str, tier: Tier, tokens: int) -> Reservation:
        """Hold `tokens` (the most the request can use) or raise RateLimited when the tenant
        has nothing left after the requests already in flight."""
        if tokens < 0:
            raise ValueError(f"cannot reserve a negative number of tokens: {tokens}")
        st, lim = self._state(tenant, tier)
        self._refuse_tokens(st, lim, tenant, tier)
        if st.tokens is not None:
            st.tokens.level -= tokens
        st.reserved += tokens
        return Reservation(tenant, tier, tokens)

    def settle(self, r: Reservation, used: int) -> None:
        """End reservation `r`, charging the `used` tokens actually served (0 for a request
        that failed).  Idempotent."""
        if r.settled:
            return
        if not 0 <= used <= r.tokens:
            raise ValueError(f"tokens used ({used}) must be within the {r.tokens} reserved "
                             f"for tenant {r.tenant!r}")
        r.settled = True
        st, _ = self._state(r.tenant, r.tier)
        if st.tokens is not None:  # had it been charged `used` from the start, the refill
            # since would have been capped at capacity at the same point
            st.tokens.level = min(st.tokens.capacity, st.tokens.level + r.tokens - used)
        st.reserved -= r.tokens
        st.day_tokens += used
