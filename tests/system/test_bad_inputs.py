"""A battery of bad requests against the real server: each gets a 4xx with the OpenAI error shape
naming the field where there is one, none a 5xx, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.system.conftest import MODEL, assert_openai_error, auth, wait_for

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]
GOOD = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
LONG_PROMPT = "word " * 700        # > 512 tokens, the preset's max_model_len
INVALID_UTF8 = b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
LONE_SURROGATE = b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800"}]}'

# (id, path, body: dict (sent as JSON) or bytes (sent raw), status, param, code)
CASES = [
    ("malformed-json", CHAT, b'{"model": "smollm2", "messages": [', 400, None, "invalid_json"),
    ("json-not-object", CHAT, b'[1, 2, 3]', 400, None, "invalid_json"),
    ("empty-body", CHAT, b"", 400, None, "invalid_json"),
    ("invalid-utf8", CHAT, INVALID_UTF8, 400, None, "invalid_utf8"),
    ("lone-surrogate", CHAT, LONE_SURROGATE, 400, "messages[0].content", None),
    ("missing-model", CHAT, {"messages": MSGS}, 400, "model", "missing_required_parameter"),
    ("model-not-string", CHAT, {**GOOD, "model": 7}, 400, "model", "invalid_type"),
    ("unknown-model", CHAT, {**GOOD, "model": "gpt-17"}, 404, "model", "model_not_found"),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages", None),
    ("messages-not-list", CHAT, {**GOOD, "messages": "Hi"}, 400, "messages", "invalid_type"),
    ("empty-messages", CHAT, {**GOOD, "messages": []}, 400, "messages", "invalid_value"),
    ("bad-role", CHAT, {**GOOD, "messages": [{"role": "wizard", "content": "Hi"}]}, 400,
     "messages[0].role", "invalid_value"),
    ("content-not-text", CHAT, {**GOOD, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", "invalid_type"),
    ("max-tokens-0", CHAT, {**GOOD, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("max-tokens-negative", CHAT, {**GOOD, "max_tokens": -5}, 400, "max_tokens",
     "invalid_value"),
    ("max-tokens-huge", CHAT, {**GOOD, "max_tokens": 10 ** 9}, 400, "max_tokens",
     "context_length_exceeded"),
    ("max-tokens-string", CHAT, {**GOOD, "max_tokens": "ten"}, 400, "max_tokens",
     "invalid_type"),
    ("temperature-high", CHAT, {**GOOD, "temperature": 2.5}, 400, "temperature",
     "invalid_value"),
    ("temperature-negative", CHAT, {**GOOD, "temperature": -0.1}, 400, "temperature",
     "invalid_value"),
    ("temperature-string", CHAT, {**GOOD, "temperature": "hot"}, 400, "temperature",
     "invalid_type"),
    ("top-p-zero", CHAT, {**GOOD, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("n-zero", CHAT, {**GOOD, "n": 0}, 400, "n", "invalid_value"),
    ("n-too-many", CHAT, {**GOOD, "n": 50}, 400, "n", "invalid_value"),
    ("stream-not-bool", CHAT, {**GOOD, "stream": "yes"}, 400, "stream", "invalid_type"),
    ("seed-float", CHAT, {**GOOD, "seed": 1.5}, 400, "seed", "invalid_type"),
    ("stop-too-many", CHAT, {**GOOD, "stop": [str(i) for i in range(17)]}, 400, "stop",
     "invalid_value"),
    ("top-logprobs-high", CHAT, {**GOOD, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs", "invalid_value"),
    ("unknown-field", CHAT, {**GOOD, "frobnicate": True}, 400, "frobnicate",
     "unrecognized_argument"),
    ("bad-tool", CHAT, {**GOOD, "tools": [{"type": "function"}]}, 400, "tools[0]",
     "invalid_value"),
    ("chat-over-context", CHAT, {**GOOD, "messages": [{"role": "user", "content": LONG_PROMPT}]},
     400, "messages", "context_length_exceeded"),
    ("prompt-over-context", COMPLETIONS, {"model": MODEL, "prompt": LONG_PROMPT}, 400, "prompt",
     "context_length_exceeded"),
    ("prompt-ids-outside-vocab", COMPLETIONS, {"model": MODEL, "prompt": [1, 2, 10 ** 7]}, 400,
     "prompt", "invalid_value"),
    ("prompt-wrong-type", COMPLETIONS, {"model": MODEL, "prompt": {"text": "hi"}}, 400, "prompt",
     "invalid_type"),
    ("oversized-body", CHAT, {**GOOD, "messages": [{"role": "user", "content": "x" * 70_000}]},
     413, None, "request_too_large"),
]


@pytest.fixture(scope="module")
def client(front):
    with httpx.Client(base_url=front.url, headers=auth("bad-inputs"), timeout=30) as c:
        yield c


@pytest.mark.parametrize(("path", "body", "status", "param", "code"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_4xx(client, path, body, status, param, code):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, content=json.dumps(body).encode(),
                        headers={"Content-Type": "application/json"})
    err = assert_openai_error(r, status, code)
    assert err["param"] == param, err
    assert r.headers.get("x-request-id")


def test_wrong_method_and_path_get_openai_4xx(client):
    assert_openai_error(client.get(CHAT), 405)
    assert_openai_error(client.post("/v1/nothing-here", json=GOOD), 404)


def test_server_keeps_serving_after_the_battery(front, client):
    r = client.post(CHAT, json={"model": MODEL, "max_tokens": 12, "temperature": 0,
                                "messages": [{"role": "user",
                                              "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    five_xx = {lv: v for (n, lv), v in front.metrics().items()   # (/ready said 503 at start)
               if n == "xlaserve_http_responses_total" and dict(lv)["endpoint"] != "other"
               and dict(lv)["status"].startswith("5")}
    assert not five_xx
    assert wait_for(front.engine_idle, 10)
