"""The gateway of a real server (configs/front.toml: HS256 JWTs with an audience, a request rate
for the free tier, a daily token quota for the paid tier): bad credentials get 401, a tenant
over its rate or quota gets 429, and one tenant's prefix-cache blocks never serve another."""

from __future__ import annotations

import httpx
import pytest

from tests.system.conftest import (
    MODEL,
    assert_openai_error,
    auth,
    make_token,
    wait_for,
)

BODY = {"model": MODEL, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}]}


def post(front, headers: dict[str, str], body: dict | None = None) -> httpx.Response:
    return httpx.post(front.url + "/v1/chat/completions", json=body or BODY, headers=headers,
                      timeout=60)


@pytest.mark.parametrize("authorization", [
    None,
    f"Bearer {make_token('mallory', secret='not-the-server-secret-0123456789abcdef')}",
    f"Bearer {make_token('late', expires_in=-60)}",
    f"Bearer {make_token('elsewhere', audience='some-other-service')}",
    f"Bearer {make_token('nobody')[:-4]}",          # truncated signature
    f"Basic {make_token('wrong-scheme')}",
], ids=["no-token", "bad-signature", "expired", "wrong-audience", "truncated", "not-bearer"])
def test_bad_credentials_get_401(front, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    r = post(front, headers)
    err = assert_openai_error(r, 401, "invalid_api_key")
    assert err["type"] == "authentication_error"
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert_openai_error(httpx.get(front.url + "/v1/models", headers=headers, timeout=10), 401)


def test_request_rate_limit_gets_429(front):
    headers = auth("rate-limited", "free")        # limits.free: 3 requests per minute
    for _ in range(3):
        assert post(front, headers).status_code == 200
    r = post(front, headers)
    assert_openai_error(r, 429, "rate_limit_exceeded")
    assert int(r.headers["Retry-After"]) >= 1
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert post(front, auth("someone-else", "free")).status_code == 200  # per tenant


def test_daily_token_quota_gets_429(front):
    headers = auth("quota", "paid")               # limits.paid: 30 tokens per day
    first = post(front, headers)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 30
    r = post(front, headers)
    err = assert_openai_error(r, 429, "daily_quota_exceeded")
    assert "quota" in err["message"]
    assert int(r.headers["Retry-After"]) >= 1
    assert r.headers["x-ratelimit-remaining-tokens-day"] == "0"


def test_prefix_cache_is_never_shared_across_tenants(front, tokenizer):
    text = ("You are reviewing a long design document about a distributed key-value store. "
            "It covers replication, consensus with Raft, compaction, snapshots, the write-ahead "
            "log, read repair, hinted handoff and anti-entropy with Merkle trees. Summarise it "
            "in one sentence.")
    body = {**BODY, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    assert len(tokenizer.encode_chat(body["messages"])) >= 4 * 16

    def cached(tenant: str) -> int:
        r = post(front, auth(tenant), body)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 3 * 16         # A's second request reuses A's blocks
    assert cached("tenant-b") == 0              # B never gets A's
    assert cached("tenant-b") >= 3 * 16         # (B's own blocks, it does)
    assert wait_for(front.engine_idle, 10)
