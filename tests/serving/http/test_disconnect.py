"""A client that goes away (while queued, in prefill, or in decode) aborts its engine request
at once and every KV block comes back; each such request still gets its audit line (499), and a
request the server itself breaks gets a 500 one."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx
import pytest
from tests.serving.live_server import wait_for
from tests.serving.fake_engine import FakeEngine

from xlaserve.serving.server_config import AuditConfig, ServedModel, ServerConfig

# A plain prompt: its reversal never reaches an EOS id, so generation runs to max_tokens.
BODY = {"model": "fake", "prompt": "tell me a long story", "max_tokens": 200}
URL = "/v1/completions"


def engine_of(srv):
    return srv.state.router.groups[0].replicas[0].engine


def test_disconnect_during_decode_stream(make_server):
    srv = make_server(token_delay=0.05)
    eng = engine_of(srv)
    with httpx.Client(timeout=10) as c, c.stream("POST", srv.url + URL,
                  json={**BODY, "stream": True}) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 4:
                assert eng.blocks_in_use > 0 and eng.running
                break  # closing the iterator closes the connection
    t0 = time.monotonic()
    assert wait_for(lambda: eng.blocks_in_use == 0 and not eng.running, 3)
    assert time.monotonic() - t0 < 2  # far sooner than the 10 s the generation would take
    assert len(eng.aborted) == 1
    assert srv.state.router.groups[0].admission.running == 0


def test_disconnect_during_prefill_nonstream(make_server):
    srv = make_server(prefill_delay=30)
    eng = engine_of(srv)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + URL, json=BODY, timeout=0.5)
    assert wait_for(lambda: eng.blocks_in_use == 0 and not eng.running, 3)
    assert len(eng.aborted) == 1 and eng.finished


def test_disconnect_while_queued(make_server, tokenizer):
    from tests.serving.fake_engine import FakeEngine

    cfg = ServerConfig(models=(ServedModel("fake", max_inflight=1, max_queue=4),))
    eng = FakeEngine(tokenizer, "fake", token_delay=0.1)
    srv = make_server(cfg, {"fake@1": [eng]})
    adm = srv.state.router.groups[0].admission
    first = threading.Thread(target=lambda: httpx.post(
        srv.url + URL, json={**BODY, "max_tokens": 15}, timeout=10))
    first.start()
    assert wait_for(lambda: adm.running == 1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + URL, json=BODY, timeout=0.4)
    assert wait_for(lambda: adm.waiting == 0, 2)
    first.join(10)
    assert wait_for(lambda: adm.running == 0)
    assert len(eng.submitted) == 1  # the queued request never reached the engine
    assert eng.blocks_in_use == 0


def test_n2_disconnect_aborts_both(make_server):
    srv = make_server(token_delay=0.05)
    eng = engine_of(srv)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + URL, json={**BODY, "n": 2}, timeout=0.4)
    assert wait_for(lambda: eng.blocks_in_use == 0 and not eng.running, 3)
    assert len(eng.aborted) == 2


def audit_lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_disconnect_while_queued_is_audited(make_server, tokenizer, tmp_path):
    audit = tmp_path / "audit.jsonl"
    cfg = ServerConfig(models=(ServedModel("fake", max_inflight=1, max_queue=4),),
                       audit=AuditConfig(path=str(audit)))
    srv = make_server(cfg, {"fake@1": [FakeEngine(tokenizer, "fake", token_delay=0.1)]})
    adm = srv.state.router.groups[0].admission
    first = threading.Thread(target=lambda: httpx.post(
        srv.url + URL, json={**BODY, "max_tokens": 10}, timeout=10,
        headers={"x-request-id": "runs"}))
    first.start()
    assert wait_for(lambda: adm.running == 1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + URL, json=BODY, timeout=0.4, headers={"x-request-id": "gone"})
    first.join(10)
    assert wait_for(lambda: len(audit_lines(audit)) == 2)
    by_id = {x["request_id"]: x for x in audit_lines(audit)}
    assert by_id["runs"]["status"] == 200
    gone = by_id["gone"]
    assert (gone["status"], gone["error"], gone["tenant"], gone["model"]) == (
        499, "client_disconnected", "local", "fake@1")
    assert gone["prompt_tokens"] == gone["completion_tokens"] == 0


class MalformedEventEngine(FakeEngine):
    """A server-side bug: events come with logprobs None instead of a tuple, so the response
    code fails on them (not the client's doing, not a disconnect)."""

    async def submit(self, request):
        async for ev in super().submit(request):
            yield dataclasses.replace(ev, logprobs=None)


@pytest.mark.parametrize("stream", [False, True])
def test_server_error_mid_response_is_audited_500(make_server, tokenizer, tmp_path, stream):
    audit = tmp_path / "audit.jsonl"
    cfg = ServerConfig(models=(ServedModel("fake"),), audit=AuditConfig(path=str(audit)))
    eng = MalformedEventEngine(tokenizer, "fake")
    srv = make_server(cfg, {"fake@1": [eng]})
    body = {**BODY, "max_tokens": 5, "logprobs": 1, "stream": stream}
    if stream:
        # the headers (200) were sent before the failure: the stream is cut
        with pytest.raises(httpx.HTTPError), \
                httpx.stream("POST", srv.url + URL, json=body, timeout=10) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass
    else:
        r = httpx.post(srv.url + URL, json=body, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert wait_for(lambda: len(audit_lines(audit)) == 1)
    assert audit_lines(audit)[0]["status"] == 500
    assert wait_for(lambda: eng.blocks_in_use == 0 and not eng.running)
