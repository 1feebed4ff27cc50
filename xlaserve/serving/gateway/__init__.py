"""The gateway: who is asking (JWT -> Principal), may they (rate limits, quotas), and what
happened (audit log, request ids / W3C trace context).

    request headers --auth.Authenticator--> Principal(tenant, tier, models)
                    --ratelimit.RateLimiter.check()--> ok | RateLimited(retry_after, headers)
    tokenized       --ratelimit.RateLimiter.reserve(most tokens it can use)--> Reservation
    ... engine ...
                    --ratelimit.RateLimiter.settle(reservation, tokens served)
                    --audit.AuditLog.write(record)             (one JSONL line per request)
"""
