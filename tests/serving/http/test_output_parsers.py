"""The chat output parsers on their own (http/chat_output.py, reasoning.py, tool_syntax.py): fed
a text in any pieces (whole, one character at a time, seeded random splits), the same reasoning,
content and calls; and which syntax each family's template picks."""

from __future__ import annotations

import random

import pytest

from tests.chat_templates import GRANITE3_3, LLAMA3_2, MISTRAL_NEMO, QWEN2_5, QWEN3
from xlaserve.serving.http.chat_output import ChatOutputParser
from xlaserve.serving.http.reasoning import ReasoningParser
from xlaserve.serving.http.tool_syntax import syntax_of, tool_parser_for

CALL = '{"name": "f", "arguments": {"x": "é"}}'
CASES = [   # (syntax, reasoning block?, text, (reasoning, content, calls))
    ("hermes", True, f"<think>\nhm </thinking>\n</think>\n\nSure.\n<tool_call>\n{CALL}\n"
     "</tool_call>", ("\nhm </thinking>\n", "Sure.\n", [("f", '{"x": "é"}')])),
    ("hermes", True, "No thinking here <think> x", ("", "No thinking here <think> x", [])),
    ("hermes", True, "<think>cut off mid-thou", ("cut off mid-thou", "", [])),
    ("mistral", False, f"[TOOL_CALLS][{CALL}, {CALL}]", ("", "", [("f", '{"x": "é"}')] * 2)),
    ("mistral", False, 'ok [TOOL_CALLS]f[ARGS]{"x": "é"}', ("", "ok ", [("f", '{"x": "é"}')])),
    ("mistral", False, "[TOOL_CALLS] broken {", ("", "[TOOL_CALLS] broken {", [])),
    ("granite", False, f"<|tool_call|>[{CALL}]", ("", "", [("f", '{"x": "é"}')])),
    ("granite", False, "<|tool_cal", ("", "<|tool_cal", [])),
    ("llama3", False, '{"name": "f", "parameters": {"x": "é"}}', ("", "", [("f", '{"x": "é"}')])),
    ("llama3", False, '<|python_tag|>{"name": "f", "parameters": {}}', ("", "", [("f", "{}")])),
    ("llama3", False, '{"answer": 42}', ("", '{"answer": 42}', [])),
]


def run(syntax: str, reasons: bool, pieces: list[str]) -> tuple[str, str, list]:
    p = ChatOutputParser(ReasoningParser() if reasons else None, tool_parser_for(syntax, "c"))
    r = c = ""
    calls = []
    for piece in pieces:
        out = p.feed(piece)
        r, c, calls = r + out.reasoning, c + out.content, calls + out.calls
    out = p.finish()
    return r + out.reasoning, c + out.content, [(k.name, k.arguments)
                                                for k in calls + out.calls]


@pytest.mark.parametrize("syntax, reasons, text, want", CASES)
def test_any_split_gives_the_same_output(syntax, reasons, text, want) -> None:
    assert run(syntax, reasons, [text]) == want
    assert run(syntax, reasons, list(text)) == want
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert run(syntax, reasons, pieces) == want, pieces


def test_each_family_template_picks_its_syntax() -> None:
    assert [syntax_of(t) for t in (QWEN2_5, QWEN3, MISTRAL_NEMO, LLAMA3_2, GRANITE3_3)] == [
        "hermes", "hermes", "mistral", "llama3", "granite"]
