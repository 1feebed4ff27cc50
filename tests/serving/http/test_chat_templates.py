"""Each family's own chat template (Qwen2.5, Qwen3, Gemma 2 and 3, Phi-3.5 and 4, Granite 3.3,
Mistral Nemo, Llama 3.2) through the HTTP server: the richest conversation the template
accepts (system, user, assistant, tool calls and their results where it has them), sent as an
OpenAI request, reaches the engine as exactly the ids transformers' `apply_chat_template` gives
for the same conversation in transformers' form (tool-call arguments as objects).  Gemma's
templates refuse a system role (Gemma 2) or a tool turn: a 400 naming the role.  Stop tokens
come from generation_config.json.  Tokenizers: tests/chat_templates.py (small, trained there;
the templates verbatim)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest

from tests.chat_templates import FAMILIES, converted_tokenizer, tokenizer_folder
from tests.serving.fake_engine import FakeEngine
from xlaserve.serving.server_config import ServedModel, ServerConfig
from xlaserve.serving.tokenizer import Tokenizer, tokenizer_from_hf

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _call(call_id: str, city: str) -> dict:
    return {"id": call_id, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city}, ensure_ascii=False)}}


def tool_turns(ids: tuple[str, ...] = ("call_1", "call_2")) -> list[dict]:
    """system, user, an assistant turn calling a tool once per id, the results, an answer, and
    the next question."""
    cities = ("Paris", "東京")[:len(ids)]
    return [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": f"What is the weather in {' and in '.join(cities)}?"},
            {"role": "assistant", "content": None,
             "tool_calls": [_call(i, c) for i, c in zip(ids, cities)]},
            *({"role": "tool", "tool_call_id": i, "content": w}
              for i, w in zip(ids, ("18°C, sunny", "22°C, rain"))),
            {"role": "assistant", "content": "Paris: 18°C, sunny. 東京: 22°C, rain."},
            {"role": "user", "content": "Thanks! And tomorrow?"}]


TOOL_TURNS = tool_turns()
PLAIN_TURNS = [{"role": "system", "content": "You are a terse assistant."},
               {"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": "  18°C and sunny.  "},
               {"role": "user", "content": "And in 東京?"}]
# per family: (request fields) for each conversation its template renders in full
CASES = {
    "qwen2.5": [{"messages": TOOL_TURNS, "tools": [WEATHER]}, {"messages": PLAIN_TURNS}],
    "qwen3": [
        {"messages": TOOL_TURNS, "tools": [WEATHER]},
        # after the last user turn: the earlier reasoning is rendered in <think>
        {"messages": TOOL_TURNS[:2] + [{**TOOL_TURNS[2], "reasoning_content": "Two cities."}]
         + TOOL_TURNS[3:5], "tools": [WEATHER]},
        {"messages": PLAIN_TURNS, "chat_template_kwargs": {"enable_thinking": False}}],
    "gemma2": [{"messages": PLAIN_TURNS[1:]}],
    "gemma3": [{"messages": PLAIN_TURNS}],
    "phi3.5": [{"messages": PLAIN_TURNS}],
    "phi4": [{"messages": PLAIN_TURNS}],
    "granite3.3": [{"messages": TOOL_TURNS, "tools": [WEATHER]}, {"messages": PLAIN_TURNS}],
    # Mistral's template takes call ids of 9 letters and digits; Llama 3.2's one call a turn
    "mistral-nemo": [{"messages": tool_turns(("a1b2c3d4e", "f5g6h7i8j")), "tools": [WEATHER]},
                     {"messages": PLAIN_TURNS}],
    "llama3.2": [{"messages": tool_turns(("call_1",)), "tools": [WEATHER]},
                 {"messages": PLAIN_TURNS}],
}


def transformers_form(messages: list[dict]) -> list[dict]:
    """The conversation as transformers' docs write it: tool-call arguments as objects, an
    assistant turn that only calls tools with empty content."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Tokenizer]]:
    """family -> (its HF folder, xlaserve's tokenizer converted from it)."""
    return {name: converted_tokenizer(name, tmp_path_factory.mktemp(name.replace(".", "_")))
            for name in FAMILIES}


@pytest.fixture
def server(make_server, folders):
    """One live server with a fake engine per family (model name = family)."""
    config = ServerConfig(models=tuple(ServedModel(name) for name in FAMILIES))
    engines = {m.id: [FakeEngine(folders[m.name][1], m.name)] for m in config.models}
    return make_server(config, engines), engines


def _post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)


def test_each_family_template_gives_transformers_ids(server, folders) -> None:
    from transformers import AutoTokenizer

    srv, engines = server
    for name, cases in CASES.items():
        hf = AutoTokenizer.from_pretrained(folders[name][0])
        engine = next(e[0] for e in engines.values() if e[0].model_name == name)
        for case in cases:
            r = _post(srv, {"model": name, "max_tokens": 1, **case})
            assert r.status_code == 200, (name, r.text)
            want = hf.apply_chat_template(
                transformers_form(case["messages"]), tools=case.get("tools"),
                add_generation_prompt=True, tokenize=True, return_dict=False,
                **case.get("chat_template_kwargs", {}))
            got = engine.submitted[-1].prompt_token_ids
            assert list(got) == list(want), (name, hf.decode(got), hf.decode(want))
            if name.startswith("qwen") and "tools" in case:   # the calls, in Hermes syntax
                assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}' \
                    '\n</tool_call>' in hf.decode(got)


@pytest.mark.parametrize("family, messages, role", [
    ("gemma2", PLAIN_TURNS, "System role not supported"),
    ("gemma2", TOOL_TURNS[1:], "the template has no 'tool' role"),
    ("gemma3", TOOL_TURNS, "the template has no 'tool' role")])
def test_a_role_the_template_refuses_is_a_400_naming_it(server, family, messages, role) -> None:
    r = _post(server[0], {"model": family, "max_tokens": 1, "messages": messages})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert role in err["message"] and err["param"] == "messages", err


def test_stop_tokens_from_generation_config(server, folders) -> None:
    for name, (src, tok) in folders.items():
        fam = FAMILIES[name]
        want = {tok.token_to_id(t) for t in (fam.eos, *fam.stops)}
        assert set(tok.eos_ids) == want, name
    srv, engines = server
    gemma = folders["gemma2"][1]
    assert _post(srv, {"model": "gemma2", "messages": PLAIN_TURNS[1:2]}).status_code == 200
    sent = next(e[0] for e in engines.values() if e[0].model_name == "gemma2").submitted[-1]
    # the engine is told to stop at <end_of_turn> too, whatever config.json's eos_token_id is
    assert gemma.token_to_id("<end_of_turn>") in sent.sampling.stop_token_ids


def test_bad_template_kwargs_and_arguments_name_the_field(server) -> None:
    srv = server[0]
    r = _post(srv, {"model": "qwen3", "messages": PLAIN_TURNS,
                    "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == \
        "chat_template_kwargs.add_generation_prompt", r.text
    bad = copy.deepcopy(TOOL_TURNS)
    bad[2]["tool_calls"][1]["function"]["arguments"] = "{not json"
    r = _post(srv, {"model": "qwen2.5", "messages": bad, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == \
        "messages[2].tool_calls[1].function.arguments", r.text


def test_plain_prompts_tokenize_as_transformers_does(folders) -> None:
    """A completion prompt: transformers' `tokenizer(text)` ids, BOS and all, whether the
    tokenizer_config says add_bos_token (Gemma) or only tokenizer.json's post-processor adds
    it (Llama 3)."""
    from transformers import AutoTokenizer

    text = "The weather in Paris: 18°C. 東京?"
    for name, (src, tok) in folders.items():
        want = AutoTokenizer.from_pretrained(src)(text)["input_ids"]
        assert tok.encode(text) == list(want), name
    assert folders["llama3.2"][1].add_bos and not folders["qwen3"][1].add_bos


def test_named_templates_tool_use_when_tools_are_given(tmp_path) -> None:
    """A tokenizer_config.json whose `chat_template` is a list of named templates (Hermes 2 Pro,
    Command R): the "tool_use" one when the request has tools, "default" otherwise, as in
    transformers."""
    from transformers import AutoTokenizer

    from tests.chat_templates import PHI3_5, QWEN2_5
    from xlaserve.serving.http.tools import parse_tools, render_messages

    src = tokenizer_folder("qwen2.5", tmp_path / "hf")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": PHI3_5},
                            {"name": "tool_use", "template": QWEN2_5}]
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "xla").mkdir()
    tokenizer_from_hf(src, tmp_path / "xla", [])
    tok, hf = Tokenizer.load(tmp_path / "xla"), AutoTokenizer.from_pretrained(src)
    turns = [{**m, "content": m["content"] or ""} for m in TOOL_TURNS]   # as protocol gives
    for tools in (None, [WEATHER]):
        msgs, specs = render_messages(turns, parse_tools({"tools": tools}),
                                      tok.template_takes_tools)
        want = hf.apply_chat_template(transformers_form(TOOL_TURNS), tools=tools,
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        assert tok.encode_chat(msgs, specs) == list(want), tools
    assert "<tools>" in tok.apply_chat_template(msgs, tools=specs)
