"""http/render.py without HTTP: a Generation on the fake engine rendered as one JSON body or as
SSE chunks, with the outputs the fake engine's rule gives (its prompt reversed, logprob of the
i-th token -(i + 1) / 10); and how each ending is reported and audited."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.serving.fake_engine import FakeEngine
from xlaserve.serving.gateway.tracing import TraceContext
from xlaserve.serving.http import pipeline
from xlaserve.serving.http.protocol import parse
from xlaserve.serving.http.render import ended_by, render, token_text
from xlaserve.serving.http.server import build_state
from xlaserve.serving.http.generation import Admitted, Generation
from xlaserve.serving.http.state import ServingState
from xlaserve.serving.server_config import AuditConfig, ServedModel, ServerConfig
from xlaserve.serving.tokenizer import Tokenizer

PROMPT = [1000, 2000, 3000]


def make_state(tokenizer: Tokenizer, tmp_path: Path, **engine: Any) -> ServingState:
    cfg = ServerConfig(models=(ServedModel("fake"),),
                       audit=AuditConfig(path=str(tmp_path / "audit.jsonl")))
    return build_state(cfg, {"fake@1": [FakeEngine(tokenizer, **engine)]})


async def generation(state: ServingState, kind: str, body: dict[str, Any]) -> Generation:
    """The stages of pipeline.generate, called directly (no auth: the local tenant)."""
    principal = pipeline.authenticate(state, None)
    parsed = parse(kind, {"model": "fake", **body}, 8)
    group, prompts = pipeline.route(state, parsed, principal)
    sampling = pipeline.sampling_params(parsed, group, prompts)
    return pipeline.start_generation(state, Admitted(
        trace=TraceContext.from_headers("req-r", None), endpoint="/v1/test", arrived=0.0,
        principal=principal, parsed=parsed, group=group, prompts=prompts, sampling=sampling,
        reservation=pipeline.reserve(state, principal, prompts, parsed.n, sampling.max_tokens),
        ticket=await pipeline.admit(state, group, principal, parsed, prompts,
                                    sampling.max_tokens)))


def rendered(state: ServingState, kind: str, body: dict[str, Any]
             ) -> tuple[int, str, Generation]:
    async def scenario() -> tuple[int, str, Generation]:
        gen = await generation(state, kind, body)
        response = await render(gen)
        return response.status_code, await response.get_data(as_text=True), gen
    return asyncio.run(scenario())


def audit_line(state: ServingState) -> dict[str, Any]:
    assert state.audit is not None
    lines = state.audit.path.read_text().splitlines()
    assert len(lines) == 1
    return dict(json.loads(lines[0]))


def test_completion_json(tokenizer: Tokenizer, tmp_path: Path) -> None:
    state = make_state(tokenizer, tmp_path)
    status, text, _ = rendered(state, "completion", {"prompt": PROMPT, "max_tokens": 3,
                                                     "logprobs": 1})
    body = json.loads(text)
    pieces = [token_text(tokenizer, t) for t in PROMPT[::-1]]
    assert status == 200
    assert (body["id"], body["object"], body["model"]) == ("cmpl-req-r", "text_completion",
                                                           "fake@1")
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("".join(pieces), "length")
    assert choice["logprobs"] == {
        "tokens": pieces, "token_logprobs": [-0.1, -0.2, -0.3],
        "top_logprobs": [{token_text(tokenizer, t + 1): -(i + 1) / 10 - 1 / 100}
                         for i, t in enumerate(PROMPT[::-1])],
        "text_offset": [0, len(pieces[0]), len(pieces[0]) + len(pieces[1])]}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    line = audit_line(state)
    assert (line["status"], line["finish_reasons"], line["endpoint"]) == (
        200, ["length"], "/v1/test")


def test_tokens_as_token_ids(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name the ids (offsets still count text)."""
    state = make_state(tokenizer, tmp_path)
    _, text, _ = rendered(state, "completion", {"prompt": PROMPT, "max_tokens": 3,
                                                "logprobs": 1,
                                                "return_tokens_as_token_ids": True})
    (choice,) = json.loads(text)["choices"]
    pieces = [token_text(tokenizer, t) for t in PROMPT[::-1]]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in PROMPT[::-1]]
    assert choice["logprobs"]["top_logprobs"][0] == {f"token_id:{PROMPT[-1] + 1}": -0.11}
    assert choice["logprobs"]["text_offset"] == [0, len(pieces[0]),
                                                 len(pieces[0]) + len(pieces[1])]
    _, text, _ = rendered(state, "chat", {"messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 2, "logprobs": True,
                                          "return_tokens_as_token_ids": True})
    content = json.loads(text)["choices"][0]["logprobs"]["content"]
    assert [c["token"].split(":")[0] for c in content] == ["token_id", "token_id"]


def test_chat_stream(tokenizer: Tokenizer, tmp_path: Path) -> None:
    state = make_state(tokenizer, tmp_path)
    status, text, _ = rendered(state, "chat", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, "seed": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    events = text.split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None} for i in (0, 1)]
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    for i in (0, 1):  # seed + choice index: each choice starts one further along
        mine = [c["choices"][0] for c in chunks[1:-1] if c["choices"][0]["index"] == i]
        assert "".join(d["delta"].get("content", "") for d in mine) == tokenizer.decode(
            [prompt[::-1][i], prompt[::-1][i + 1]])
        assert [d["finish_reason"] for d in mine][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_engine_error_is_a_500_and_charges_nothing(tokenizer: Tokenizer, tmp_path: Path
                                                   ) -> None:
    state = make_state(tokenizer, tmp_path, fail_token=PROMPT[1])
    status, text, gen = rendered(state, "completion", {"prompt": PROMPT, "max_tokens": 3})
    assert status == 500
    assert json.loads(text)["error"] == {"message": "engine error: fake failure",
                                         "type": "server_error", "param": None,
                                         "code": "engine_error"}
    line = audit_line(state)
    assert (line["status"], line["finish_reasons"]) == (500, ["error"])
    assert gen.admitted.reservation.settled and gen.served_tokens() == 0


@pytest.mark.parametrize("e,ended", [
    (asyncio.CancelledError(), (499, "client_disconnected")),
    (GeneratorExit(), (499, "client_disconnected")),
    (RuntimeError("bug"), (500, "internal_error"))])
def test_ended_by(e: BaseException, ended: tuple[int, str]) -> None:
    assert ended_by(e) == ended
