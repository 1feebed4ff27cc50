"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

    request  tools + messages --render_messages--> the chat template's messages (+ `tools`
             when the template renders them; else a Hermes-style system message describing
             them), assistant `tool_calls` and `role: tool` results written as the model's
             tool-call syntax
    decode   tool_choice "required" / a named function: a grammar (`tool_constraint`) holds
             the output to one (or, with parallel_tool_calls, several) tool calls whose
             arguments follow the function's JSON schema; "auto": free text; "none": no tools
    response ToolCallParser: the output's tool-call syntax -> `tool_calls`, fed the text as it
             streams (content before a call is streamed as content, a call once it closes)

The syntax is Hermes / Qwen's, which SmolLM2 and most instruction-tuned families follow:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Llama 3's bare JSON (`{"name": ..., "parameters": ...}` as the whole answer) is read too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from xlaserve.serving.http.errors import invalid_value
from xlaserve.serving.structured.constraint import Constraint
from xlaserve.serving.structured.grammar import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
SYSTEM = ("You are a function calling AI model. You are provided with function signatures "
          "within <tools></tools> XML tags. You may call one or more functions to assist with "
          "the user query. Don't make assumptions about what values to plug into functions. "
          "Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function call "
          "return a json object with function name and arguments within <tool_call>"
          "</tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, "
          "\"arguments\": <args-dict>}}\n</tool_call>")


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict[str, Any], ...]   # {"name", "description", "parameters"}
    choice: str = "auto"                    # none | auto | required | function
    function: str | None = None             # the named function (choice "function")
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"


def _function(i: int, t: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(
            t.get("function"), dict):
        raise invalid_value(where, "must be {\"type\": \"function\", \"function\": {...}}")
    f = t["function"]
    name = f.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(
            c.isalnum() or c in "_-" for c in name):
        raise invalid_value(f"{where}.function.name", "must be 1 to 64 letters, digits, '_' or '-'")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise invalid_value(f"{where}.function.parameters",
                            "must be a JSON schema of type 'object'")
    desc = f.get("description", "")
    if not isinstance(desc, str):
        raise invalid_value(f"{where}.function.description", "must be a string")
    return {"name": name, "description": desc, "parameters": params}


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` checked; None when no tools."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid_value("parallel_tool_calls", "must be a boolean")
    if raw in (None, []):
        if choice not in (None, "none", "auto"):
            raise invalid_value("tool_choice", "requires 'tools'")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise invalid_value("tools", f"must be a list of at most {MAX_TOOLS} tools")
    functions = tuple(_function(i, t) for i, t in enumerate(raw))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid_value("tools", f"function names must be unique: {names}")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get(
            "type") == "function" else None
        if named not in names:
            raise invalid_value("tool_choice", f"names no function of 'tools' ({named!r}; "
                                               f"tools: {names})")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise invalid_value("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": "
                                           "\"function\", \"function\": {\"name\": ...}}")
    return Tools(functions, choice, named, parallel is not False)


def _call_schema(f: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": f["name"]},
                                             "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_constraint(tools: Tools) -> Constraint | None:
    """The grammar of "required" (any of the functions) or a named function: one tool call,
    or one or more when parallel calls are allowed; None for auto / none."""
    if tools.choice not in ("required", "function"):
        return None
    fs = [f for f in tools.functions if tools.choice == "required" or f["name"] == tools.function]
    schemas = [_call_schema(f) for f in fs]
    schema = {**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}),
              "x-guidance": JSON_OPTIONS}
    call = f'"{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    many = ' ("\\n" call)*' if tools.parallel else ""
    return Constraint("lark", f"start: call{many}\ncall: {call}\n")


def render_messages(messages: list[dict[str, Any]], tools: Tools | None,
                    template_takes_tools: bool) -> tuple[list[dict[str, Any]], list | None]:
    """The messages and `tools` argument the chat template gets.  Assistant tool calls and
    tool results become text in the model's syntax unless the template reads them itself."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = [{**c, "function": {"name": c["function"]["name"], "arguments": _arguments(
            c["function"]["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")}}
            for j, c in enumerate(m.pop("tool_calls", None) or [])]
        if calls and not template_takes_tools:
            text = "\n".join(f"{OPEN}\n" + json.dumps(c["function"]) + f"\n{CLOSE}"
                             for c in calls)
            m["content"] = (m.get("content") or "") + text
        elif calls:   # arguments as objects, as templates (Qwen2.5's `| tojson`) expect
            m["tool_calls"] = calls
        if m["role"] == "tool" and not template_takes_tools:
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if tools is None or not tools.active:
        return out, None
    specs = [{"type": "function", "function": f} for f in tools.functions]
    if template_takes_tools:
        return out, specs
    system = SYSTEM.format(tools="\n".join(json.dumps(s) for s in specs))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _arguments(text: str, where: str) -> dict[str, Any]:
    """An earlier call's `arguments` (JSON text, OpenAI's form) as the object it holds."""
    try:
        args = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise invalid_value(where, f"must be a JSON object ({e.msg})") from None
    if not isinstance(args, dict):
        raise invalid_value(where, "must be a JSON object")
    return args


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str   # JSON text

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallParser:
    """The text of one choice, fed as it streams -> content and tool calls.  `feed` returns
    the content safe to stream now and the calls completed; text that may still turn into a
    call (a prefix of `<tool_call>`, an open call, an answer that opens with `{` and so may be
    a bare Llama 3 call) is held back until it can be decided, so that any split of the text
    into pieces gives the same content and calls."""

    id_prefix: str
    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""
    _started: bool = False      # some content was emitted, or a tagged call seen: not bare
    _after_call: bool = False   # newlines right after a call are not content

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        if not self._started:
            head = self._held.lstrip()
            if not head or head.startswith("{"):
                return "", []          # wait: maybe the whole answer is one bare call
            self._started = True
        content, done = "", []
        while True:
            if self._after_call:
                self._held = self._held.lstrip("\n")
                if not self._held:
                    return content, done
                self._after_call = False
            start = self._held.find(OPEN)
            if start < 0:
                cut = len(self._held) - _prefix_len(self._held, OPEN)
                content += self._held[:cut]
                self._held = self._held[cut:]
                return content, done
            end = self._held.find(CLOSE, start)
            if end < 0:
                content += self._held[:start]
                self._held = self._held[start:]
                return content, done
            call = self._call(self._held[start + len(OPEN):end])
            stop = end + len(CLOSE)
            content += self._held[:start] if call else self._held[:stop]
            if call is not None:
                done.append(call)
                self._after_call = True
            self._held = self._held[stop:]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: the held text as content, or (Llama 3 style) the whole answer as one
        bare JSON call."""
        if not self._started:
            self._started = True
            call = self._call(self._held) if self._held.strip() else None
            if call is not None:
                self._held = ""
                return "", [call]
            content, calls = self.feed("")
        else:
            content, calls = "", []
        rest, self._held = self._held, ""
        return content + rest, calls

    def _call(self, text: str) -> ToolCall | None:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        call = ToolCall(len(self.calls), f"{self.id_prefix}-{len(self.calls)}", obj["name"],
                        json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        return call


def _prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
