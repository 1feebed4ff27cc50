"""A chat choice's output text -> reasoning, content and tool calls, as it streams.

The reasoning block goes first (http/reasoning.py, for models whose template reasons), then the
tool-call syntax of the family (http/tool_syntax.py) reads what remains, when the request
offered tools.  `chat_parser` picks them for a choice; None when the text is plain content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xlaserve.serving.http.reasoning import (ReasoningParser, prompt_opens_reasoning,
                                             template_reasons)
from xlaserve.serving.http.tool_syntax import ToolParser, syntax_of, tool_parser_for
from xlaserve.serving.http.tools import ToolCall, Tools
from xlaserve.serving.tokenizer import Tokenizer


@dataclass
class Parsed:
    reasoning: str
    content: str
    calls: list[ToolCall]


@dataclass
class ChatOutputParser:
    reasoning: ReasoningParser | None
    tools: ToolParser | None

    def feed(self, text: str) -> Parsed:
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        c, calls = self.tools.feed(c) if self.tools else (c, [])
        return Parsed(r, c, calls)

    def finish(self) -> Parsed:
        r, c = self.reasoning.finish() if self.reasoning else ("", "")
        calls: list[ToolCall] = []
        if self.tools:
            c, calls = self.tools.feed(c)
            rest, more = self.tools.finish()
            c, calls = c + rest, calls + more
        return Parsed(r, c, calls)

    def whole(self, text: str) -> Parsed:
        """All of a choice's text at once (a response that is not streamed)."""
        a, b = self.feed(text), self.finish()
        return Parsed(a.reasoning + b.reasoning, a.content + b.content, a.calls + b.calls)

    @property
    def made_calls(self) -> bool:
        return bool(self.tools and self.tools.calls)


def chat_parser(tok: Tokenizer, prompt_ids: list[int], tools: Tools | None, id_prefix: str
                ) -> ChatOutputParser | None:
    """The parser of one chat choice: reasoning when the model's template reasons, tool calls
    when tools were offered (in the family's syntax; in Hermes' when tool_choice forced a call,
    whose grammar writes that syntax: tools.tool_constraint); None when neither."""
    reasoning = None
    if template_reasons(tok.chat_template):
        tail = tok.decode(prompt_ids[-4:], skip_special_tokens=False)
        reasoning = ReasoningParser(in_reasoning=prompt_opens_reasoning(tail))
    parser = None
    if tools is not None and tools.active:
        # a template that does not render tools got xlaserve's Hermes system message
        own = tok.template_takes_tools and tools.choice == "auto"
        parser = tool_parser_for(syntax_of(tok.chat_template) if own else "hermes", id_prefix)
    if reasoning is None and parser is None:
        return None
    return ChatOutputParser(reasoning, parser)


def message_body(parser: ChatOutputParser | None, text: str) -> dict[str, Any]:
    """The `message` of a chat choice that is not streamed."""
    if parser is None:
        return {"role": "assistant", "content": text}
    p = parser.whole(text)
    message: dict[str, Any] = {"role": "assistant",
                               "content": p.content or None if p.calls else p.content}
    if parser.reasoning is not None:
        message["reasoning_content"] = p.reasoning or None
    if p.calls:
        message["tool_calls"] = [k.body() for k in p.calls]
    return message
