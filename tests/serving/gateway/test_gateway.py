"""JWT auth (401s), per-tenant rate limits and quotas (429 + Retry-After + x-ratelimit-*),
the audit log, and refusing to serve without auth on a non-loopback address."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jwt
import pytest
from tests.serving.live_server import wait_for

from xlaserve.serving.server_config import (
    AuditConfig,
    AuthConfig,
    ServedModel,
    ServerConfig,
    TierLimits,
)
from xlaserve.serving.types import Tier

SECRET = "test-secret-which-is-long-enough-for-hs256"
BODY = {"model": "fake", "prompt": "hello world", "max_tokens": 3}


def token(secret: str = SECRET, **claims) -> str:
    base = {"sub": "user1", "tenant": "acme", "tier": "free", "aud": "xlaserve",
            "iss": "https://issuer.test", "exp": int(time.time()) + 600}
    base.update(claims)
    return jwt.encode({k: v for k, v in base.items() if v is not None}, secret,
                      algorithm="HS256")


def post(srv, tok: str | None, body=BODY) -> httpx.Response:
    h = {"Authorization": f"Bearer {tok}"} if tok else {}
    return httpx.post(srv.url + "/v1/completions", json=body, headers=h, timeout=10)


@pytest.fixture
def auth_server(make_server, tmp_path):
    cfg = ServerConfig(
        models=(ServedModel("fake"), ServedModel("big", tiers=("paid",))),
        auth=AuthConfig(mode="hs256", secret=SECRET, audience="xlaserve",
                        issuer="https://issuer.test"),
        limits={"free": TierLimits(requests_per_minute=3, tokens_per_day=40)},
        audit=AuditConfig(path=str(tmp_path / "audit.jsonl")))
    return make_server(cfg)


def test_auth_failures_are_401(auth_server, tmp_path):
    srv = auth_server
    cases = {
        "none": None,
        "bad signature": token(secret="another-secret-that-is-also-long-enough"),
        "expired": token(exp=int(time.time()) - 10),
        "wrong audience": token(aud="someone-else"),
        "wrong issuer": token(iss="https://evil.test"),
        "not yet valid": token(nbf=int(time.time()) + 600),
        "no exp": token(exp=None),
        "garbage": "not.a.jwt",
    }
    for why, tok in cases.items():
        r = post(srv, tok)
        assert r.status_code == 401, why
        assert r.json()["error"]["type"] == "authentication_error", why
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    audit = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [x["status"] for x in audit] == [401] * len(cases)
    assert all(x["tenant"] is None for x in audit)


def test_tiers_and_model_claims(auth_server):
    srv = auth_server
    assert post(srv, token(), {**BODY, "model": "big"}).status_code == 403  # free tier
    assert post(srv, token(tier="paid"), {**BODY, "model": "big"}).status_code == 200
    r = post(srv, token(tier="paid", models=["fake"]), {**BODY, "model": "big"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "model"
    ids = [m["id"] for m in httpx.get(srv.url + "/v1/models", headers={
        "Authorization": f"Bearer {token()}"}).json()["data"]]
    assert "big" not in ids and "fake" in ids


def test_request_rate_limit_then_daily_quota(auth_server, tmp_path):
    srv = auth_server
    t = token()
    r = post(srv, t)
    assert r.status_code == 200
    assert r.headers["x-ratelimit-limit-requests"] == "3"
    assert r.headers["x-ratelimit-remaining-requests"] == "2"
    assert post(srv, t).status_code == 200
    assert post(srv, t).status_code == 200
    r = post(srv, t)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 20
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    # another tenant is not affected
    assert post(srv, token(tenant="other")).status_code == 200
    # daily quota: 3 requests x (2 prompt + 3 completion) = 15 tokens; a big one overshoots
    big = post(srv, token(tenant="q"), {**BODY, "max_tokens": 40})
    assert big.status_code == 200
    r = post(srv, token(tenant="q"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "daily_quota_exceeded"
    assert int(r.headers["Retry-After"]) <= 86400
    lines = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == [200, 200, 200, 429, 200, 200, 429]
    assert lines[3]["error"] == "rate_limit_exceeded" and lines[3]["tenant"] == "acme"
    assert lines[6]["error"] == "daily_quota_exceeded" and lines[6]["tenant"] == "q"
    rec = lines[0]
    assert rec["tenant"] == "acme" and rec["model"] == "fake@1" and rec["status"] == 200
    assert rec["prompt_tokens"] == 2 and rec["completion_tokens"] == 3
    assert "prompt" not in rec and "hello" not in json.dumps(lines)
    assert len({x["request_id"] for x in lines}) == len(lines)
    assert all(x["latency_s"] >= 0 and x["trace_id"] for x in lines)


def test_rs256_keys_from_file(make_server, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    keys = [rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(2)]
    pem = b"".join(k.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
                   for k in keys)
    (tmp_path / "keys.pem").write_bytes(pem)
    srv = make_server(ServerConfig(models=(ServedModel("fake"),), auth=AuthConfig(
        mode="rs256", public_key_file=str(tmp_path / "keys.pem"), audience="xlaserve")))
    claims = {"tenant": "t", "aud": "xlaserve", "exp": int(time.time()) + 60}
    for k in keys:  # either key of a rotation pair is accepted
        assert post(srv, jwt.encode(claims, k, algorithm="RS256")).status_code == 200
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert post(srv, jwt.encode(claims, other, algorithm="RS256")).status_code == 401
    assert post(srv, token()).status_code == 401  # HS256 token: wrong algorithm


def test_no_auth_on_public_bind_refuses_to_start():
    with pytest.raises(ValueError, match="refusing to serve without authentication"):
        ServerConfig(host="0.0.0.0", models=(ServedModel("fake"),))
    ServerConfig(host="0.0.0.0", auth=AuthConfig(mode="hs256", secret="x"))
    ServerConfig(host="::1")


def test_audit_prompts_only_when_configured(make_server, tmp_path):
    cfg = ServerConfig(models=(ServedModel("fake"),), audit=AuditConfig(
        path=str(tmp_path / "a.jsonl"), include_prompts=True))
    srv = make_server(cfg)
    assert post(srv, None).status_code == 200
    rec = json.loads((tmp_path / "a.jsonl").read_text())
    assert rec["prompt"] == ["hello world"] and rec["tenant"] == "local"


def test_requests_the_server_fails_are_not_charged(make_server, tokenizer):
    """An engine error (500, no token served) costs the tenant nothing: three times the
    quota's worth of failures later, the quota is whole and a good request is served."""
    prompt = "hello there world, how are you today?"
    ids = tokenizer.encode(prompt)
    cfg = ServerConfig(models=(ServedModel("fake"),),
                       limits={"internal": TierLimits(tokens_per_day=3 * len(ids))})
    srv = make_server(cfg, fail_token=ids[-1])   # fails on its first token: the prompt's last
    body = {"model": "fake", "prompt": prompt, "max_tokens": 5}
    for _ in range(4):
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        assert r.headers["x-ratelimit-remaining-tokens-day"] == str(3 * len(ids))
    r = httpx.post(srv.url + "/v1/completions", timeout=10,
                   json={"model": "fake", "prompt": "tell me a story", "max_tokens": 2})
    assert r.status_code == 200
    assert srv.state.limiter.headers("local", Tier.INTERNAL)[
        "x-ratelimit-remaining-tokens-day"] == str(3 * len(ids) - r.json()["usage"][
            "total_tokens"])


def test_concurrent_requests_overshoot_the_quota_by_one_request_at_most(make_server):
    quota = 50
    cfg = ServerConfig(models=(ServedModel("fake"),),
                       limits={"internal": TierLimits(tokens_per_day=quota)})
    srv = make_server(cfg, token_delay=0.02)
    body = {"model": "fake", "prompt": "hello there world how are you", "max_tokens": 20}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.gather(*(c.post(srv.url + "/v1/completions", json=body)
                                          for _ in range(20)))

    rs = asyncio.run(burst())
    ok = [r for r in rs if r.status_code == 200]
    refused = [r for r in rs if r.status_code == 429]
    assert len(ok) + len(refused) == 20 and ok
    assert {r.json()["error"]["code"] for r in refused} == {"daily_quota_exceeded"}
    size = ok[0].json()["usage"]["prompt_tokens"] + body["max_tokens"]  # one request's most
    served = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert served <= quota - 1 + size, (len(ok), served)   # was: 20/20 served, 520 tokens
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 429 and r.headers["x-ratelimit-remaining-tokens-day"] == "0"


def test_client_gone_before_its_prompt_ran_is_not_charged(make_server):
    cfg = ServerConfig(models=(ServedModel("fake"),),
                       limits={"internal": TierLimits(tokens_per_day=1000)})
    srv = make_server(cfg, prefill_delay=30)
    eng = srv.state.router.groups[0].replicas[0].engine
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=BODY, timeout=0.4)
    assert wait_for(lambda: not srv.state.generations and not eng.running)
    h = srv.state.limiter.headers("local", Tier.INTERNAL)
    assert h["x-ratelimit-remaining-tokens-day"] == "1000"
