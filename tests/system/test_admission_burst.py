"""A burst against a real server (SmolLM2, 4 sequences, an internal-tier SLO of 3 s): admission
projects each newcomer's wait from the work ahead of it (prompt + max_tokens) over the engine's
measured step costs, so the requests it admits wait in its queue within the SLO (p99, from the
server's audit lines) and get their first token within the SLO plus the step in flight and the
step with their prefill, as the server's audit and as the client measure it; the rest get 429
with a Retry-After that grows with the queue, and the server then answers normally."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.system.conftest import MODEL, HttpServer, free_port, wait_for, write_config

BURST = 40
MAX_TOKENS = 24
SLO_S = 3.0          # configs/burst.toml, internal tier
CLIENT_MARGIN_S = 1.0   # the client's own share of a first token: connect, gateway, SSE read


@pytest.fixture(scope="module")
def burst_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[HttpServer]:
    d = tmp_path_factory.mktemp("burst")
    port = free_port()
    cfg = write_config("burst.toml", d / "burst.toml", port=port, model_dir=model_dir,
                       audit=d / "audit.jsonl")
    srv = HttpServer("burst", cfg, port, d)
    srv.audit_path = d / "audit.jsonl"
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


async def stream_one(client: httpx.AsyncClient, url: str, i: int) -> dict:
    """Send one streamed chat request; its status, Retry-After and completion tokens."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Count from {i} to {i + 30}."}]}
    sent_at = time.monotonic()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        out = {"status": r.status_code, "retry_after": r.headers.get("Retry-After"),
               "tokens": 0, "answered_at": time.monotonic(), "ttft_s": None}
        if r.status_code == 429:   # turned away on arrival ("overloaded_slo") or from the queue
            out["code"] = json.loads(await r.aread())["error"]["code"]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if out["ttft_s"] is None and any(c["delta"].get("content")
                                             for c in chunk["choices"]):
                out["ttft_s"] = time.monotonic() - sent_at   # as the client sees it
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
    return out


async def burst(url: str, n: int) -> list[dict]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*[stream_one(client, url, i) for i in range(n)])


def p99(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)]


def test_burst_admits_within_the_slo_and_429s_the_rest(burst_server):
    srv = burst_server
    assert wait_for(srv.engine_idle, 30)
    results = asyncio.run(burst(srv.url, BURST))

    step_s = srv.metric("xlaserve_step_seconds")
    prefill_rate = srv.metric("xlaserve_prefill_tokens_per_second")
    assert step_s > 0 and prefill_rate > 0, "the engine measured no step costs"
    assert srv.metric("xlaserve_engine_info", attention_backend="cpu", platform="cpu",
                      dtype="float32") == 1          # `auto` on CPU: the CPU kernels
    log = srv.log_path.read_text()
    assert "attention backend: cpu on cpu, dtype float32 (requested auto)" in log, log[-2000:]
    assert "step costs: " in log
    one_step = step_s + 128 / prefill_rate     # a step with a full 128-token prefill chunk

    ok = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] == 429]
    assert len(ok) + len(rejected) == BURST, [r["status"] for r in results]
    assert len(ok) >= 4 and len(rejected) >= 1, (len(ok), len(rejected))
    served = [json.loads(line) for line in srv.audit_path.read_text().splitlines()]
    served = [a for a in served if a["status"] == 200]
    assert len(served) == len(ok)
    assert p99([a["queue_s"] for a in served]) <= SLO_S, served
    # its first token: the step in flight when it was admitted, then the one with its prefill
    assert p99([a["ttft_s"] for a in served]) <= SLO_S + 2 * one_step, served
    # and as the client measures it (its connection, the gateway and the SSE write included)
    client_ttft = [r["ttft_s"] for r in ok]
    assert all(t is not None for t in client_ttft), client_ttft
    assert p99(client_ttft) <= SLO_S + 2 * one_step + CLIENT_MARGIN_S, client_ttft
    assert all(r["tokens"] == MAX_TOKENS for r in ok), [r["tokens"] for r in ok]
    retry = [int(r["retry_after"]) for r in rejected]
    assert all(1 <= s <= 60 for s in retry), retry
    # Each request turned away on arrival books its share of the engines' time (its decode
    # steps over the 4 lanes, at least) on one horizon that only moves forward, so the times
    # they are told to come back at (answer + Retry-After) never move back by more than the
    # 1 s that rounding up takes and the client's lag in reading the answer, and they move
    # forward by a share each.  The share is the projection's step cost at the time, a moving
    # estimate that the burst itself raises: the figure read after it is up to ~2x what the
    # rejections booked (measured 0.56 s against 0.30 s), so a third of it is the bound.
    on_arrival = sorted((r for r in rejected if r["code"] == "overloaded_slo"),
                        key=lambda r: r["answered_at"])
    assert len(on_arrival) >= 2, [r["code"] for r in rejected]
    share = MAX_TOKENS * step_s / 4
    back = [r["answered_at"] + int(r["retry_after"]) for r in on_arrival]
    slack = 1.0 + CLIENT_MARGIN_S
    assert all(b >= a - slack for a, b in zip(back, back[1:])), (back, share)
    assert back[-1] - back[0] >= (len(back) - 1) * share / 3 - slack, (back, share)

    assert wait_for(srv.engine_idle, 30)
    turned_away = srv.metric("xlaserve_rejections_total", reason="slo")
    timed_out = srv.metric("xlaserve_rejections_total", reason="timeout")
    assert turned_away + timed_out == len(rejected)
    assert turned_away == len(on_arrival)   # the 429 bodies name the same reasons
    # the projection turns most away on arrival; the SLO bound catches the rest in the queue
    assert timed_out <= len(rejected) / 4, (turned_away, timed_out)
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
