"""The gateway: who is asking (JWT -> Principal), may they (rate limits, quotas), and what
happened (audit log, request ids / W3C trace context).

    request headers --auth.Authenticator--> Principal(tenant, tier, models)
                    --ratelimit.RateLimiter.check()--> ok | RateLimited(retry_after, headers)
    ... engine ...
                    --ratelimit.RateLimiter.charge(tokens)     (actual usage, after the fact)
                    --audit.AuditLog.write(record)             (one JSONL line per request)
"""
