"""Tool calls in each family's own syntax, as its chat template defines it (`syntax_of`):

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
             (Qwen2.5, Qwen3, Hermes, SmolLM2; and any model whose template does not render
             tools, which xlaserve tells to answer so: http/tools.py) -> tools.ToolCallParser
    mistral  [TOOL_CALLS] then a JSON list of {"name", "arguments"} (v3 tokenizers: Mistral 7B
             v0.3, Nemo), or name[ARGS]{...} per call (v11+: Mistral Small 3.2, Devstral)
    granite  <|tool_call|> then a JSON list of {"name", "arguments"} (Granite 3.x)
    llama3   an answer that is one JSON object {"name", "parameters"}, or several separated by
             ';', optionally after <|python_tag|> (Llama 3.1 - 3.3)

For the three marker syntaxes the content before the marker streams as it comes; everything
from the marker on is held and parsed at the end of the choice, its calls sent then (as
delta.tool_calls).  Text after a marker that does not parse as calls is returned as content,
marker included, so nothing the model wrote is lost.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from xlaserve.serving.http.tools import ToolCall, ToolCallParser, _prefix_len

MISTRAL, GRANITE, PYTHON_TAG = "[TOOL_CALLS]", "<|tool_call|>", "<|python_tag|>"
_NAME_ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


class ToolParser(Protocol):
    calls: list[ToolCall]

    def feed(self, text: str) -> tuple[str, list[ToolCall]]: ...

    def finish(self) -> tuple[str, list[ToolCall]]: ...


def syntax_of(chat_template: str | None) -> str:
    """The tool-call syntax a chat template (one that renders tools itself) teaches."""
    t = chat_template or ""
    if MISTRAL in t:
        return "mistral"
    if GRANITE in t:
        return "granite"
    if "<tool_call>" not in t and (PYTHON_TAG in t or '"parameters"' in t):
        return "llama3"
    return "hermes"


def tool_parser_for(syntax: str, id_prefix: str) -> ToolParser:
    if syntax == "mistral":
        return MarkerCallParser(id_prefix, MISTRAL)
    if syntax == "granite":
        return MarkerCallParser(id_prefix, GRANITE)
    if syntax == "llama3":
        return MarkerCallParser(id_prefix, PYTHON_TAG, bare_json=True)
    return ToolCallParser(id_prefix)


@dataclass
class MarkerCallParser:
    """Content up to `marker`, calls after it (parsed at `finish`).  With `bare_json` an answer
    that opens with `{` is calls too (Llama 3's JSON tool calling has no marker)."""

    id_prefix: str
    marker: str
    bare_json: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""
    _started: bool = False    # some content was let through
    _calling: bool = False    # the marker (or a bare JSON answer) was seen
    _marked: bool = False     # ... and it was the marker

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        if self._calling:
            return "", []
        if not self._started:
            head = self._held.lstrip()
            if not head or self.marker.startswith(head):
                return "", []             # wait: maybe the answer opens with the marker
            if self.bare_json and head.startswith("{"):
                self._calling = True
                return "", []
            self._started = True
        i = self._held.find(self.marker)
        if i >= 0:
            content, self._held = self._held[:i], self._held[i + len(self.marker):]
            self._calling = self._marked = True
            return content, []
        cut = len(self._held) - _prefix_len(self._held, self.marker)
        content, self._held = self._held[:cut], self._held[cut:]
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._held = self._held, ""
        if not self._calling:
            return text, []
        items = parse_calls(text)
        if items is None:
            return (self.marker if self._marked else "") + text, []
        for name, args in items:
            n = len(self.calls)
            self.calls.append(ToolCall(n, self._id(n), name, json.dumps(args, ensure_ascii=False)))
        return "", list(self.calls)


    def _id(self, n: int) -> str:
        """Mistral's templates take back only ids of 9 letters and digits."""
        if self.marker == MISTRAL:
            return hashlib.sha256(f"{self.id_prefix}-{n}".encode()).hexdigest()[:9]
        return f"{self.id_prefix}-{n}"


def parse_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls in the text after a marker: JSON objects or lists of them, separated by
    whitespace, ',' or ';' (or the marker again); or Mistral v11's name[ARGS]{...} per call.
    None when anything in it is not a call."""
    decoder = json.JSONDecoder()
    out: list[tuple[str, dict[str, Any]]] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] in ",;"):
            pos += 1
        for tag in (MISTRAL, PYTHON_TAG):
            if text.startswith(tag, pos):
                pos += len(tag)
        if pos >= n:
            return out or None
        named = _NAME_ARGS.match(text, pos)
        try:
            value, pos = decoder.raw_decode(text, named.end() if named else pos)
        except json.JSONDecodeError:
            return None
        if named:
            value = {"name": named.group(1), "arguments": value}
        for item in value if isinstance(value, list) else [value]:
            call = _call(item)
            if call is None:
                return None
            out.append(call)


def _call(item: Any) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):       # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (item["name"], args) if isinstance(args, dict) else None
