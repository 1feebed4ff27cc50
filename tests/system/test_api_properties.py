"""Property-based API tests: schemathesis generates requests from our own OpenAPI document
(valid ones and ones that break it: wrong types, out-of-range values, unknown fields, missing
fields) and sends them to the real SmolLM2 server (the session's `front`).  Every response is
a 2xx whose body matches the document's response model (each event of a stream too, and no
error event unless the request broke the document), or a 4xx with the OpenAI error shape;
never a 5xx, a hang (a 60 s read timeout) or a dropped connection.

Bounded: a fixed number of examples per operation and a derandomized seed, so a run is the same
set of requests each time; generated bodies run on the model with at most 4 new tokens
(`max_tokens` is clamped, never added where it is wrong) so the whole test takes about a minute.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.system.conftest import MODEL, assert_openai_error, auth, wait_for
from xlaserve.serving.http.openapi import (ChatCompletion, ChatCompletionChunk, Completion,
                                           ErrorResponse, ModelList, openapi_document)

pytestmark = pytest.mark.slow

schema = schemathesis.openapi.from_dict(openapi_document())
schema.config.generation.update(modes=list(schemathesis.GenerationMode), deterministic=True)
MAX_NEW_TOKENS = 4
EXAMPLES = 120   # per operation (the GET ones have far fewer distinct requests)
STATUSES: list[tuple[str, int]] = []   # (method, status) of every generated request
RESPONSES = {"/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
             "/v1/completions": (Completion, Completion),
             "/v1/models": (ModelList, None)}


def bounded(body: Any) -> Any:
    """The generated body, on the served model and with few new tokens.  Only values already
    of the right kind change (a string model, an integer max_tokens >= 1), so what a body
    breaks stays broken; a body that sets no max_tokens gets one (a chat would otherwise run
    to the end of the context)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    keys = [k for k in ("max_tokens", "max_completion_tokens") if k in body]
    for k in keys:
        v = body[k]
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_NEW_TOKENS:
            body[k] = MAX_NEW_TOKENS
    if not keys:
        body["max_tokens"] = MAX_NEW_TOKENS
    return body


def check_stream(text: str, chunk_model: type, errors_allowed: bool = False) -> None:
    """Server-sent events: each data line a chunk, the last [DONE]; an error event (in the
    error shape) only where `errors_allowed` (the request broke the document), since a valid
    request's 200 stream has nothing to fail on."""
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    for e in events[:-1]:
        body = json.loads(e)
        if "error" in body:
            assert errors_allowed, f"an error event in a valid request's stream: {e[:300]}"
            ErrorResponse.model_validate(body)
        else:
            chunk_model.model_validate(body)


def generated_invalid(case: Any) -> bool:
    """Was `case` generated to break the document (schemathesis' negative mode)?"""
    meta = case.meta
    return meta is not None and meta.generation.mode == schemathesis.GenerationMode.NEGATIVE


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_generated_requests_never_5xx(case, front):
    case.body = bounded(case.body)
    r = case.call(base_url=front.url, headers=auth("properties"), timeout=60)
    STATUSES.append((case.method.upper(), r.status_code))
    assert r.status_code < 500, (r.status_code, r.text[:500], case.as_curl_command())
    if r.status_code >= 400:
        assert_openai_error(r)
        return
    models = RESPONSES.get(case.path)
    if models is None or case.method.upper() != case.operation.method.upper():
        return    # (the coverage phase also tries methods a path does not document: OPTIONS)
    content_type = (r.headers.get("content-type") or [""])[0]   # schemathesis: header lists
    if content_type.startswith("text/event-stream"):
        check_stream(r.text, models[1], errors_allowed=generated_invalid(case))
    else:
        assert r.content, (r.status_code, case.method, case.path, case.as_curl_command())
        models[0].model_validate(r.json())


def test_server_serves_after_the_generated_requests(front):
    """Runs after the generated requests (file order): they exercised the model, not only the
    validators, and the server still answers."""
    import httpx

    answered = sum(s == ("POST", 200) for s in STATUSES)
    assert len(STATUSES) >= 500 and answered >= 50, Counter(STATUSES)

    r = httpx.post(front.url + "/v1/chat/completions", headers=auth("properties"), timeout=60,
                   json={"model": MODEL, "max_tokens": 3,
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    assert wait_for(front.engine_idle, 10)


def test_openapi_document_served(front):
    """GET /openapi.json (no token needed): OpenAPI 3, both generation paths with their
    request bodies, every $ref resolving."""
    import httpx

    doc = httpx.get(front.url + "/openapi.json", timeout=30).json()
    assert doc == json.loads(json.dumps(openapi_document()))
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = body["schema"]["$ref"].rsplit("/", 1)[1]
        assert field in schemas[name]["properties"] and field in schemas[name]["required"]
    refs = {m for m in json.dumps(doc).split('"$ref": "')[1:]}
    for ref in refs:
        assert ref.split('"', 1)[0].rsplit("/", 1)[1] in schemas, ref


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
SHAPES = [   # (path, body): each answer form the document describes, from the real model
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True},
                              "logprobs": True, "top_logprobs": 1, "n": 2}),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "required", "max_tokens": 48,
                              "parallel_tool_calls": False}),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "required", "max_tokens": 48,
                              "parallel_tool_calls": False,
                              "stream": True}),
    ("/v1/completions", {"prompt": ["Once upon", "a time"], "logprobs": 2}),
    ("/v1/completions", {"prompt": [1, 2, 3], "stream": True,
                         "stream_options": {"include_usage": True}}),
]


@pytest.mark.parametrize(("path", "extra"), SHAPES)
def test_answers_match_the_document(front, path, extra):
    import httpx

    prompt = ({"messages": [{"role": "user", "content": "What time is it?"}]}
              if path.endswith("chat/completions") else {})
    body = {"model": MODEL, "max_tokens": 3, **prompt, **extra}
    r = httpx.post(front.url + path, json=body, headers=auth("properties"), timeout=60)
    assert r.status_code == 200, r.text
    response_model, chunk_model = RESPONSES[path]
    if body.get("stream"):
        check_stream(r.text, chunk_model)
    else:
        response_model.model_validate(r.json())
    if "tools" in body and not body.get("stream"):
        assert r.json()["choices"][0]["message"].get("tool_calls"), r.text
