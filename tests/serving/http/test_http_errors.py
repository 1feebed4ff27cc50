"""Bad input gets a 4xx with an OpenAI-shaped error naming the field; never a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest

from xlaserve.serving.server_config import AuditConfig, ServedModel, ServerConfig

CHAT = [{"role": "user", "content": "hi"}]

# (endpoint, body (dict, or raw bytes), status, param)
CASES = [
    ("chat", b"{not json", 400, None),
    ("chat", b"[1, 2]", 400, None),
    ("chat", b'{"model": "fake", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     None),
    ("chat", {"model": "fake", "messages": [{"role": "user", "content": "\ud800"}]}, 400,
     "messages[0].content"),
    ("chat", {"messages": CHAT}, 400, "model"),
    ("chat", {"model": 7, "messages": CHAT}, 400, "model"),
    ("chat", {"model": "nope", "messages": CHAT}, 404, "model"),
    ("chat", {"model": "fake"}, 400, "messages"),
    ("chat", {"model": "fake", "messages": []}, 400, "messages"),
    ("chat", {"model": "fake", "messages": "hi"}, 400, "messages"),
    ("chat", {"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("chat", {"model": "fake", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("chat", {"model": "fake", "messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"model": "fake", "messages": CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("chat", {"model": "fake", "messages": CHAT, "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("chat", {"model": "fake", "messages": CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("chat", {"model": "fake", "messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat", {"model": "fake", "messages": CHAT, "max_completion_tokens": 10 ** 9}, 400,
     "max_completion_tokens"),
    # unknown fields named by a lone surrogate: no UTF-8 form, sent back \u-escaped
    ("chat", (b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}], '
              b'"\\udcff": 1}'), 400, "\udcff"),
    ("completion", b'{"model": "fake", "prompt": "hi", "\\ud800": 1}', 400, "\ud800"),
    # rejected by json with RecursionError / ValueError rather than JSONDecodeError
    ("completion", b'{"model": "fake", "prompt": "hi", "metadata": ' + b"[" * 20000
     + b"]" * 20000 + b"}", 400, None),
    ("completion", b'{"model": "fake", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
     400, None),
    ("chat", {"model": "fake", "messages": CHAT, "temperature": 2.5}, 400, "temperature"),
    ("chat", {"model": "fake", "messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("chat", {"model": "fake", "messages": CHAT, "temperature": True}, 400, "temperature"),
    ("chat", {"model": "fake", "messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("chat", {"model": "fake", "messages": CHAT, "top_k": -5}, 400, "top_k"),
    ("chat", {"model": "fake", "messages": CHAT, "top_k": 2 ** 31}, 400, "top_k"),
    ("chat", {"model": "fake", "messages": CHAT, "min_p": 1.5}, 400, "min_p"),
    ("chat", {"model": "fake", "messages": CHAT, "n": 0}, 400, "n"),
    ("chat", {"model": "fake", "messages": CHAT, "n": 1000}, 400, "n"),
    ("chat", {"model": "fake", "messages": CHAT, "stop": [1]}, 400, "stop"),
    ("chat", {"model": "fake", "messages": CHAT, "stop": [""]}, 400, "stop"),
    ("chat", {"model": "fake", "messages": CHAT, "seed": "x"}, 400, "seed"),
    ("chat", {"model": "fake", "messages": CHAT, "seed": 2 ** 64}, 400, "seed"),
    ("chat", {"model": "fake", "messages": CHAT, "n": 2.5}, 400, "n"),
    ("chat", {"model": "fake", "messages": CHAT, "stream": "yes"}, 400, "stream"),
    ("chat", {"model": "fake", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content"),
    ("chat", {"model": "fake", "messages": CHAT, "presence_penalty": 3}, 400,
     "presence_penalty"),
    ("chat", {"model": "fake", "messages": CHAT, "frequency_penalty": -3}, 400,
     "frequency_penalty"),
    ("chat", {"model": "fake", "messages": CHAT, "logprobs": 3}, 400, "logprobs"),
    ("chat", {"model": "fake", "messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("chat", {"model": "fake", "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"model": "fake", "messages": CHAT, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("chat", {"model": "fake", "messages": CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ("chat", {"model": "fake", "messages": CHAT, "tools": [{"type": "function"}]}, 400,
     "tools[0]"),
    ("chat", {"model": "fake", "messages": CHAT, "tool_choice": "required"}, 400,
     "tool_choice"),
    ("chat", {"model": "fake", "messages": CHAT, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ("completion", {"model": "fake", "prompt": "x", "guided_choice": "yes"}, 400,
     "guided_choice"),
    ("completion", {"model": "fake", "prompt": "x", "tools": []}, 400, "tools"),
    ("chat", {"model": "fake", "messages": CHAT, "priority": "high"}, 400, "priority"),
    ("chat", {"model": "fake", "messages": [{"role": "user", "content": "word " * 600}]}, 400,
     "messages"),
    ("completion", {"model": "fake"}, 400, "prompt"),
    ("completion", {"model": "fake", "prompt": 12}, 400, "prompt"),
    ("completion", {"model": "fake", "prompt": []}, 400, "prompt"),
    ("completion", {"model": "fake", "prompt": [10 ** 7]}, 400, "prompt"),
    ("completion", {"model": "fake", "prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("completion", {"model": "fake", "prompt": "hi", "echo": True}, 400, "echo"),
    ("completion", {"model": "fake", "prompt": ["a"] * 5, "n": 2}, 400, "n"),
]


@pytest.fixture(scope="module")
def srv(tokenizer):
    from tests.serving.live_server import LiveServer
    from tests.serving.fake_engine import FakeEngine

    from xlaserve.serving.http.server import build_state

    cfg = ServerConfig(models=(ServedModel("fake"),), max_body_bytes=64 * 1024)
    s = LiveServer(build_state(cfg, {"fake@1": [FakeEngine(tokenizer, "fake",
                                                           max_model_len=512)]})).start()
    yield s
    s.stop()


@pytest.mark.parametrize("endpoint,body,status,param", CASES)
def test_bad_input(srv, endpoint, body, status, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if isinstance(body, bytes):
        r = httpx.post(srv.url + path, content=body,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(srv.url + path, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["message"]


def test_oversized_body_and_unknown_route(srv):
    big = b'{"model": "fake", "prompt": "' + b"a" * (100 * 1024) + b'"}'
    r = httpx.post(srv.url + "/v1/completions", content=big,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(srv.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_ignored_fields_accepted(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", json={
        "model": "fake", "messages": CHAT, "max_tokens": 1, "user": "u1", "metadata": {"a": 1},
        "logit_bias": {}, "response_format": {"type": "text"}, "top_k": -1})
    assert r.status_code == 200, r.text
    assert srv.state.router.groups[0].replicas[0].engine.blocks_in_use == 0


def test_unparsable_json_and_surrogates_are_400_and_audited(make_server, tmp_path):
    """Bodies json rejects with RecursionError / ValueError, and a "model" no UTF-8 can hold:
    a 400 and an audit line each (were 500s, and the audit write itself failed)."""
    audit = tmp_path / "audit.jsonl"
    srv = make_server(ServerConfig(models=(ServedModel("fake"),),
                                   audit=AuditConfig(path=str(audit))))
    bodies = [b'{"model": "fake", "prompt": "hi", "metadata": ' + b"[" * 100000
              + b"]" * 100000 + b"}",
              b'{"model": "fake", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
              b'{"model": "\\ud800", "prompt": "hi"}']
    for i, body in enumerate(bodies):
        r = httpx.post(srv.url + "/v1/completions", content=body,
                       headers={"content-type": "application/json", "x-request-id": f"b{i}"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == ("invalid_json" if i < 2 else "invalid_value")
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [(x["request_id"], x["status"], x["error"]) for x in lines] == [
        ("b0", 400, "invalid_json"), ("b1", 400, "invalid_json"), ("b2", 400, "invalid_value")]
    assert lines[2]["model"] == "\ud800"
