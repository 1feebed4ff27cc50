"""Clients that go away at each phase of a request (waiting in the admission queue, waiting in
the engine behind running requests, during a long prompt's prefill, mid-decode) abort it, and
afterwards GET /metrics shows zero KV blocks in use and nothing running or waiting.

Clients here are raw sockets: a request is written, and "going away" is closing the socket,
whatever the request's phase (an HTTP client library would block until response headers).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

from tests.system.conftest import MODEL, HttpServer, make_token, wait_for

STORY = "Count from 1 to 300, one number per line."


class RawRequest:
    def __init__(self, server: HttpServer, tenant: str, body: dict, path: str):
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                f"Authorization: Bearer {make_token(tenant)}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        self.sock.sendall(head.encode() + data)
        self.received = b""

    def read_until(self, done: Callable[[bytes], bool], timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while not done(self.received) and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            self.received += chunk
        return done(self.received)

    def close(self) -> None:
        """The client goes away."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def chat(server: HttpServer, tenant: str, content: str, max_tokens: int,
         stream: bool = True) -> RawRequest:
    return RawRequest(server, tenant, {
        "model": MODEL, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, "stream": stream}, "/v1/chat/completions")


def tokens_counted(front: HttpServer, tenant: str) -> tuple[float, float]:
    """(prompt, completion) tokens the server charged `tenant` (after its requests closed)."""
    return (front.metric("xlaserve_prompt_tokens_total", tenant=tenant),
            front.metric("xlaserve_generation_tokens_total", tenant=tenant))


def test_disconnect_queued_in_admission_queued_in_engine_and_mid_decode(front):
    assert wait_for(front.engine_idle, 30)
    aborts_before = front.metric("xlaserve_request_success_total", finished_reason="abort")
    m = front.metric
    # two requests fill the engine's batch (max_num_seqs = 2) and decode...
    blockers = [chat(front, "disc-block", STORY, 300) for _ in range(2)]
    assert wait_for(lambda: m("xlaserve_num_requests_running") == 2, 30)
    # ...two more wait in the engine behind them (max_inflight = 4)...
    engine_q = [chat(front, "disc-engine-q", "Name three colours.", 16) for _ in range(2)]
    assert wait_for(lambda: m("xlaserve_num_requests_waiting") == 2, 10)
    # ...and one waits in the admission queue.
    admit_q = chat(front, "disc-admit-q", "Name three animals.", 16)
    assert wait_for(lambda: m("xlaserve_admission_waiting") == 1, 10), \
        (m("xlaserve_rejections_total", reason="slo"), admit_q.read_until(bool, 1) and
         admit_q.received[:300])   # refused (429) rather than queued: by whom and why
    assert m("xlaserve_admission_running") == 4

    admit_q.close()
    assert wait_for(lambda: m("xlaserve_admission_waiting") == 0, 5)
    assert m("xlaserve_admission_running") == 4  # the others are untouched

    for r in engine_q:
        r.close()
    assert wait_for(lambda: m("xlaserve_num_requests_waiting") == 0, 5)
    assert m("xlaserve_num_requests_running") == 2
    assert wait_for(lambda: m("xlaserve_admission_running") == 2, 5)
    # they reached the engine (prompts counted) but never produced a token
    prompt, completion = tokens_counted(front, "disc-engine-q")
    assert prompt > 0 and completion == 0
    assert tokens_counted(front, "disc-admit-q") == (0, 0)  # never admitted

    # mid-decode: each blocker has streamed a few tokens and holds KV blocks
    for r in blockers:
        assert r.read_until(lambda b: b.count(b"data: ") >= 4), r.received[-300:]
    assert m("xlaserve_kv_cache_usage_perc") > 0
    for r in blockers:
        r.close()
    t0 = time.monotonic()
    assert wait_for(front.engine_idle, 5)
    assert time.monotonic() - t0 < 3  # far sooner than 300 tokens would take
    assert m("xlaserve_request_success_total", finished_reason="abort") - aborts_before == 4
    _, completion = tokens_counted(front, "disc-block")
    assert 6 <= completion < 2 * 300


def test_disconnect_during_long_prefill(front, tokenizer):
    assert wait_for(front.engine_idle, 30)
    # ~470 prompt tokens: 4 prefill chunks of 128, seconds on a CPU, before the first token
    words = " ".join(f"item{i}" for i in range(400))
    content = "Repeat the following list back to me: " + words
    while len(tokenizer.encode_chat([{"role": "user", "content": content}])) > 480:
        content = content.rsplit(" ", 1)[0]
    n_prompt = len(tokenizer.encode_chat([{"role": "user", "content": content}]))
    assert n_prompt > 3 * 128

    r = chat(front, "disc-prefill", content, 8, stream=False)
    # the prefill has started when the request holds KV blocks
    assert wait_for(lambda: front.metric("xlaserve_kv_cache_usage_perc") > 0, 30, 0.01)
    r.close()
    assert wait_for(front.engine_idle, 5)
    assert wait_for(lambda: tokens_counted(front, "disc-prefill")[0] > 0, 5)
    assert tokens_counted(front, "disc-prefill") == (n_prompt, 0)  # no token was generated
    assert r.received == b""  # and nothing was answered


def test_server_serves_after_disconnects(front):
    import httpx

    r = httpx.post(front.url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {make_token('disc-after')}"},
                   json={"model": MODEL, "max_tokens": 12, "temperature": 0,
                         "messages": [{"role": "user", "content": "What is the capital of "
                                                                  "France?"}]})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    assert wait_for(front.engine_idle, 5)
