"""What the server makes of a model's output, per family, through the HTTP layer: fake engines
answer a text chosen here (FakeEngine `reply`), with tokenizers of the families whose templates
define the syntax (tests/chat_templates.py).  Qwen3's <think> block becomes `reasoning_content`
(and `delta.reasoning_content` streamed), `enable_thinking: false` reaches the template; tool
calls in Hermes (Qwen), Mistral's [TOOL_CALLS], Llama 3's JSON and Granite's <|tool_call|> come
back as `tool_calls`, streamed as `delta.tool_calls`; the same text with no tools offered (or
no reasoning) stays content."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.chat_templates import converted_tokenizer
from tests.serving.fake_engine import FakeEngine
from xlaserve.serving.server_config import ServedModel, ServerConfig

FAMILIES = ("qwen3", "mistral-nemo", "llama3.2", "granite3.3")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris and 東京?"}]
PARIS, TOKYO = {"city": "Paris"}, {"city": "東京"}
THOUGHT = "<think>\nThe user wants the weather.\nTwo cities.\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {n: converted_tokenizer(n, tmp_path_factory.mktemp(n.replace(".", "_")))[1]
            for n in FAMILIES}


@pytest.fixture
def server(make_server, tokenizers):
    """One server, a fake engine per family (model name = family); `answer(family, text)`
    sets what that engine replies."""
    config = ServerConfig(models=tuple(ServedModel(n) for n in FAMILIES))
    engines = {m.id: [FakeEngine(tokenizers[m.name], m.name, reply="")] for m in config.models}
    by_name = {e[0].model_name: e[0] for e in engines.values()}

    def answer(family: str, text: str) -> FakeEngine:
        eng = by_name[family]
        tok = tokenizers[family]
        eng.reply_ids = [*tok.encode(text, add_special_tokens=False), tok.eos_ids[0]]
        return eng

    return make_server(config, engines), answer


def chat(srv, family: str, stream: bool = False, **body) -> dict | list[dict]:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
        "model": family, "messages": ASK, "stream": stream, **body})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def streamed(chunks: list[dict]) -> tuple[str, str, list[tuple[str, dict]], str]:
    """(reasoning, content, calls as (name, arguments), finish_reason) of a stream."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for ch in chunks:
        for c in ch["choices"]:
            d = c["delta"]
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            for t in d.get("tool_calls") or []:
                k = calls.setdefault(t["index"], {"name": "", "arguments": ""})
                k["name"] += (t.get("function") or {}).get("name") or ""
                k["arguments"] += (t.get("function") or {}).get("arguments") or ""
            finish = c["finish_reason"] or finish
    return (reasoning, content, [(k["name"], json.loads(k["arguments"]))
                                 for _, k in sorted(calls.items())], finish)


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []]


def test_qwen3_reasoning_split_whole_and_streamed(server) -> None:
    srv, answer = server
    answer("qwen3", THOUGHT + "Paris: sunny. 東京: rain.")
    m = chat(srv, "qwen3")["message"]
    assert m["reasoning_content"] == "\nThe user wants the weather.\nTwo cities.\n"
    assert m["content"] == "Paris: sunny. 東京: rain."
    assert streamed(chat(srv, "qwen3", stream=True)) == (
        m["reasoning_content"], m["content"], [], "stop")


def test_qwen3_enable_thinking_false_reaches_the_template(server, tokenizers) -> None:
    srv, answer = server
    eng = answer("qwen3", "Sunny.")
    m = chat(srv, "qwen3", chat_template_kwargs={"enable_thinking": False})["message"]
    prompt = tokenizers["qwen3"].decode(eng.submitted[-1].prompt_token_ids,
                                        skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), prompt
    assert m == {"role": "assistant", "content": "Sunny.", "reasoning_content": None}
    chat(srv, "qwen3")
    assert "<think>" not in tokenizers["qwen3"].decode(eng.submitted[-1].prompt_token_ids,
                                                       skip_special_tokens=False)


def test_qwen3_reasoning_then_hermes_tool_calls(server) -> None:
    srv, answer = server
    answer("qwen3", THOUGHT + '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
           '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
           '{"city": "東京"}}\n</tool_call>')
    choice = chat(srv, "qwen3", tools=[WEATHER])
    m = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and m["content"] is None
    assert m["reasoning_content"].startswith("\nThe user wants")
    assert calls_of(m) == [("get_weather", PARIS), ("get_weather", TOKYO)]
    r, c, calls, finish = streamed(chat(srv, "qwen3", stream=True, tools=[WEATHER]))
    assert (r, c, calls, finish) == (m["reasoning_content"], "", calls_of(m), "tool_calls")


@pytest.mark.parametrize("family, text", [
    ("mistral-nemo", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                     '{"name": "get_weather", "arguments": {"city": "東京"}}]'),
    ("mistral-nemo", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                     '[TOOL_CALLS]get_weather[ARGS]{"city": "東京"}'),       # v11 tokenizers
    ("llama3.2", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                 '{"name": "get_weather", "parameters": {"city": "東京"}}'),
    ("granite3.3", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                   '{"name": "get_weather", "arguments": {"city": "東京"}}]')])
def test_each_family_tool_syntax(server, family, text) -> None:
    srv, answer = server
    answer(family, text)
    choice = chat(srv, family, tools=[WEATHER])
    m = choice["message"]
    assert calls_of(m) == [("get_weather", PARIS), ("get_weather", TOKYO)], m
    assert choice["finish_reason"] == "tool_calls" and m["content"] is None
    assert m.get("reasoning_content") is None   # (Granite 3.3's template can think: None)
    if family == "mistral-nemo":                # ids its template takes back
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in m["tool_calls"])
    assert streamed(chat(srv, family, stream=True, tools=[WEATHER]))[1:] == (
        "", calls_of(m), "tool_calls")
    plain = chat(srv, family)["message"]        # no tools offered: the text is content
    assert (plain["content"], plain.get("tool_calls")) == (text, None)


def test_content_before_a_marker_streams_and_bad_calls_stay_content(server) -> None:
    srv, answer = server
    answer("granite3.3", 'Let me check. <|tool_call|>[{"name": "get_weather", "arguments": '
                         '{"city": "Paris"}}]')
    r, c, calls, finish = streamed(chat(srv, "granite3.3", stream=True, tools=[WEATHER]))
    assert (c, calls, finish) == ("Let me check. ", [("get_weather", PARIS)], "tool_calls")
    answer("mistral-nemo", "[TOOL_CALLS] not a call")
    choice = chat(srv, "mistral-nemo", tools=[WEATHER])
    assert choice["message"] == {"role": "assistant", "content": "[TOOL_CALLS] not a call"}
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_a_forced_call_is_read_in_the_syntax_its_grammar_writes(server, choice) -> None:
    """tool_choice required / a named function: the grammar writes Hermes blocks (whatever the
    family), and they are read back as calls."""
    srv, answer = server
    answer("mistral-nemo", '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                           '"Paris"}}\n</tool_call>')
    choice_ = chat(srv, "mistral-nemo", tools=[WEATHER], tool_choice=choice)
    assert calls_of(choice_["message"]) == [("get_weather", PARIS)]
