"""Tool calling's host parts: request checks, prompt rendering, the forced-call grammar against
SmolLM2's tokenizer, and the streaming tool-call parser (fed in any pieces, the same calls)."""

from __future__ import annotations

import json

import pytest

from xlaserve.serving.http.errors import ApiError
from xlaserve.serving.http.structured import parse_constraint
from xlaserve.serving.http.tools import (
    ToolCallParser,
    Tools,
    parse_tools,
    render_messages,
    tool_constraint,
)
from xlaserve.serving.structured.grammar import GrammarCompiler
from xlaserve.serving.tokenizer import Tokenizer

F = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
TEXT = ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')


def _parse_in(pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    p = ToolCallParser("call_x")
    content, calls = "", []
    for piece in pieces:
        c, k = p.feed(piece)
        content, calls = content + c, calls + k
    c, k = p.finish()
    return content + c, [(x.name, x.arguments) for x in calls + k]


def test_parser_gives_the_same_calls_whatever_the_pieces() -> None:
    whole = _parse_in([TEXT])
    assert whole == ("Sure. ", [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3, "b": 4}')])
    assert _parse_in(list(TEXT)) == whole                      # one character at a time
    assert _parse_in([TEXT[:9], TEXT[9:40], TEXT[40:]]) == whole


def test_parser_holds_back_only_what_may_become_a_call() -> None:
    p = ToolCallParser("c")
    assert p.feed("a <tool") == ("a ", [])       # maybe the start of a call: held
    assert p.feed("box> b") == ("<toolbox> b", [])
    assert _parse_in(["<tool_call>not json</tool_call> x"]) == (
        "<tool_call>not json</tool_call> x", [])
    assert _parse_in(['{"name": "add", "parameters": {"a": 1}}']) == (
        "", [("add", '{"a": 1}')])                 # Llama 3: the bare JSON answer
    assert _parse_in(["<tool_call>\n{\"name\": \"add\""]) == ('<tool_call>\n{"name": "add"', [])


def test_request_checks_name_the_field() -> None:
    assert parse_tools({"tools": [F]}) == Tools((F["function"] | {"description": ""},))
    for body, param in (({"tools": [F], "tool_choice": "always"}, "tool_choice"),
                        ({"tools": [F, F]}, "tools"),
                        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                         "tools[0].function.name"),
                        ({"tool_choice": {"type": "function", "function": {"name": "add"}}},
                         "tool_choice"),
                        ({"tools": [F], "parallel_tool_calls": "yes"}, "parallel_tool_calls")):
        with pytest.raises(ApiError) as e:
            parse_tools(body)
        assert e.value.param == param, (body, e.value.message)
    with pytest.raises(ApiError) as e:
        parse_constraint({"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert e.value.param == "structured_outputs"


def test_messages_round_trip_into_the_template(model_dir) -> None:
    tok = Tokenizer.load(model_dir)
    tools = parse_tools({"tools": [F]})
    call = {"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs, for_template = render_messages(
        [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "",
                                              "tool_calls": [call]},
         {"role": "tool", "content": "3", "tool_call_id": "c1"}], tools,
        tok.template_takes_tools)
    assert for_template is None and not tok.template_takes_tools   # SmolLM2's template
    text = tok.apply_chat_template(msgs)
    assert '"name": "add"' in text and "<tools>" in text           # the system message
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\n3\n</tool_response>" in text


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammar_takes_calls_and_nothing_else(model_dir, parallel) -> None:
    tok = Tokenizer.load(model_dir)
    grammars = GrammarCompiler(tok, tok.vocab_size)
    c = tool_constraint(parse_tools({"tools": [F], "tool_choice": "required",
                                     "parallel_tool_calls": parallel}))

    def accepts(text: str) -> bool:
        state = grammars.start(c)
        return all(state.accept(t) for t in tok.encode(text, add_special_tokens=False)) \
            and state.accept(tok.eos_ids[0])

    one = TEXT[len("Sure. "):TEXT.index("\n<tool_call>", 10)]
    assert json.loads(one[len("<tool_call>\n"):-len("\n</tool_call>")])["name"] == "add"
    assert accepts(one)
    assert accepts(TEXT[len("Sure. "):]) == parallel
    assert not accepts(one.replace('"b": 2', '"c": 2'))
