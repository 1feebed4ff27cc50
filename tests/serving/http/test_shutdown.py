"""Shutdown drains: once stopping, /ready and new requests answer 503 with Retry-After, running
requests may finish within `server.drain_timeout_s`, and those still running after it end with
an explicit "server shutting down" error (SSE error event before [DONE], or a 503 body) — never a
cut connection — with every KV block back."""

from __future__ import annotations

import json
import threading
import time

import httpx
from tests.serving.live_server import wait_for

from xlaserve.serving.server_config import ServedModel, ServerConfig

URL = "/v1/completions"
LONG = {"model": "fake", "prompt": "tell me a long story", "max_tokens": 200}


def engine_of(srv):
    return srv.state.router.groups[0].replicas[0].engine


def config(drain_s: float) -> ServerConfig:
    return ServerConfig(models=(ServedModel("fake"),), drain_timeout_s=drain_s)


def test_stream_still_running_after_the_drain_ends_with_an_error_event(make_server):
    srv = make_server(config(0.5), token_delay=0.05)     # 200 tokens would take 10 s
    eng = engine_of(srv)
    events: list[str] = []
    with httpx.Client(timeout=20) as c, c.stream("POST", srv.url + URL,
                                                 json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    started = time.monotonic()
                    srv.begin_stop()
    elapsed = time.monotonic() - started
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert len(texts) >= 3 and all(texts)
    assert 0.4 < elapsed < 5, elapsed          # the drain window, then stopped at once
    assert wait_for(lambda: eng.blocks_in_use == 0 and not eng.running, 3)
    assert len(eng.aborted) == 1
    srv.stop()


def test_requests_finishing_within_the_drain_complete_and_new_ones_get_503(make_server):
    srv = make_server(config(10.0), token_delay=0.05)
    eng = engine_of(srv)
    result: dict[str, httpx.Response] = {}

    def slow_request() -> None:   # 30 tokens: ~1.5 s, well inside the 10 s drain
        with httpx.Client(timeout=20) as c:
            result["r"] = c.post(srv.url + URL, json={**LONG, "max_tokens": 30})

    t = threading.Thread(target=slow_request)
    t.start()
    assert wait_for(lambda: bool(eng.running), 5)
    srv.begin_stop()
    assert wait_for(lambda: srv.state.draining, 2)
    with httpx.Client(timeout=5) as c:
        ready = c.get(srv.url + "/ready")
        late = c.post(srv.url + URL, json={**LONG, "max_tokens": 2})
    assert ready.status_code == 503 and ready.json()["ready"] is False
    assert late.status_code == 503 and late.headers["Retry-After"] == "5"
    assert late.json()["error"]["code"] == "server_shutting_down"
    t.join(15)
    r = result["r"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 30
    srv.stop()
    assert eng.blocks_in_use == 0 and not eng.aborted


def test_nonstream_request_stopped_by_the_drain_gets_a_503(make_server):
    srv = make_server(config(0.3), token_delay=0.05)
    eng = engine_of(srv)
    result: dict[str, httpx.Response] = {}

    def long_request() -> None:
        with httpx.Client(timeout=20) as c:
            result["r"] = c.post(srv.url + URL, json=LONG)

    t = threading.Thread(target=long_request)
    t.start()
    assert wait_for(lambda: bool(eng.running), 5)
    srv.begin_stop()
    t.join(10)
    r = result["r"]
    assert r.status_code == 503 and r.headers["Retry-After"] == "5"
    assert r.json()["error"]["code"] == "server_shutting_down"
    assert wait_for(lambda: eng.blocks_in_use == 0, 3) and len(eng.aborted) == 1
    srv.stop()
