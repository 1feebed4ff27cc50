"""OpenAI request validation for /v1/chat/completions and /v1/completions, and `ApiError`,
the OpenAI-shaped error every failure answers with (responses: http/render.py).

Every bad input raises `ApiError` (400 unless said otherwise) naming the offending field in
`param`.  Unknown fields: OpenAI answers 400 "Unrecognized request argument supplied", and so do
we, except for fields that carry no behaviour here (`user`, `metadata`, `store`,
`service_tier`) which are accepted and ignored.  Fields we know but do not implement
(`logit_bias`, `functions`, `echo`, `suffix`, ...) are accepted only at their default
(null / empty / false) and otherwise get a 400 saying they are not supported, so a client never
silently gets different behaviour than it asked for.  Output constraints (`response_format`,
`guided_*`, `structured_outputs`) are read by http/structured.py, tools by http/tools.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from werkzeug.exceptions import HTTPException

from xlaserve.serving.structured.constraint import Constraint
from xlaserve.serving.types import MAX_INT32

if TYPE_CHECKING:
    from xlaserve.serving.http.tools import Tools


class ApiError(Exception):
    """An error answered with an OpenAI-shaped body {"error": {message, type, param, code}}."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
        404: "invalid_request_error", 405: "invalid_request_error",
        413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
        503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_http(cls, e: HTTPException, max_body_bytes: int) -> ApiError:
        """A werkzeug HTTP error (body over `max_body_bytes`, no such route, wrong method)."""
        codes = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}
        msg = (f"Request body exceeds the limit of {max_body_bytes} bytes" if e.code == 413
               else e.description or e.name)
        return cls(e.code or 400, msg, None, codes.get(e.code or 400))


IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})
# field -> the values accepted (only the default behaviour is implemented)
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}), "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "prediction": (None,), "audio": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,),
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
           "seed", "presence_penalty", "frequency_penalty", "logprobs", "stream",
           "stream_options", "priority", "ignore_eos", "response_format", "guided_json",
           "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "speculative"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                         "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ParsedRequest:
    kind: str                         # "chat" | "completion"
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)   # chat
    prompts: list[str | list[int]] = field(default_factory=list)   # completion
    max_tokens: int | None = None     # None: fill the context (chat) / 16 (completion)
    max_tokens_param: str = "max_tokens"  # the field the client set it with, for errors
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None       # top-k alternatives wanted; None = no logprobs
    priority: int = 0
    speculative: bool = True          # false: this request never verifies draft tokens
    user: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs
    constraint: Constraint | None = None   # what the output must match (http/structured.py)
    constraint_param: str | None = None    # the field that set it, for errors
    tools: Tools | None = None             # chat: the tools offered (http/tools.py)


# -- field readers ------------------------------------------------------------------------------

def _type_error(name: str, want: str, value: Any) -> ApiError:
    return ApiError(400, f"Invalid type for '{name}': expected {want}, got "
                         f"{type(value).__name__} ({json.dumps(value)[:60]})", name,
                    "invalid_type")


def _value_error(name: str, why: str, value: Any) -> ApiError:
    return ApiError(400, f"Invalid value for '{name}': {why} (got {json.dumps(value)[:60]})",
                    name, "invalid_value")


def _int(body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None
         ) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _type_error(name, "an integer", v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _value_error(name, f"must be between {lo} and {hi}" if hi is not None
                           else f"must be >= {lo}", v)
    return int(v)


def _float(body: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False
           ) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "a number", v)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise _value_error(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]", v)
    return float(v)


def _bool(body: dict[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _text(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{name}' is not valid UTF-8 text (lone surrogate)", name,
                       "invalid_value") from None
    return v


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for k, v in body.items():
        if k in allowed or k in IGNORED_FIELDS:
            continue
        if k in _DEFAULT_ONLY:
            if v not in _DEFAULT_ONLY[k]:
                raise ApiError(400, f"'{k}' is not supported by this server (only its default "
                                    "is accepted)", k, "unsupported_parameter")
            continue
        raise ApiError(400, f"Unrecognized request argument supplied: {k}", k,
                       "unrecognized_argument")


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"Request body is not valid UTF-8 ({e.reason} at byte {e.start})",
                       None, "invalid_utf8") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"Request body is not valid JSON: {e.msg} at line {e.lineno} "
                            f"column {e.colno}", None, "invalid_json") from None
    except RecursionError:
        raise ApiError(400, "Request body is not valid JSON: nested too deeply", None,
                       "invalid_json") from None
    except ValueError as e:  # an integer literal over sys.get_int_max_str_digits() digits
        raise ApiError(400, f"Request body is not valid JSON: {e}", None,
                       "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object", None, "invalid_json")
    return body


def _parse_common(body: dict[str, Any], kind: str, max_n: int) -> ParsedRequest:
    model = body.get("model")
    if model is None:
        raise ApiError(400, "Missing required parameter: 'model'", "model",
                       "missing_required_parameter")
    model = _text(model, "model")
    if not model:
        raise _value_error("model", "must not be empty", model)
    p = ParsedRequest(kind, model)
    n = _int(body, "n", 1, max_n)
    p.n = 1 if n is None else n
    p.stream = bool(_bool(body, "stream"))
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        if not p.stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true",
                           "stream_options", "invalid_value")
        bad = set(so) - {"include_usage", "continuous_usage_stats"}
        if bad:
            raise ApiError(400, f"Unrecognized stream_options field(s): {sorted(bad)}",
                           "stream_options", "unrecognized_argument")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _type_error("stream_options.include_usage", "a boolean", iu)
        p.include_usage = bool(iu)
    prio = _int(body, "priority", -1000, 1000)
    p.priority = prio or 0
    spec = body.get("speculative")   # our extension: opt out of speculative decoding
    if spec is not None:
        if not isinstance(spec, bool):
            raise _type_error("speculative", "a boolean", spec)
        p.speculative = spec
    user = body.get("user")
    if user is not None:
        p.user = _text(user, "user")
    s: dict[str, Any] = {}
    for name, lo, hi, lo_open in (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True),
                                  ("min_p", 0.0, 1.0, False),
                                  ("presence_penalty", -2.0, 2.0, False),
                                  ("frequency_penalty", -2.0, 2.0, False)):
        v = _float(body, name, lo, hi, lo_open)
        if v is not None:
            s[name] = v
    top_k = _int(body, "top_k", -1, MAX_INT32)
    if top_k is not None:
        s["top_k"] = max(top_k, 0)  # -1 (vLLM) and 0 both mean off
    seed = _int(body, "seed", -(2 ** 63), 2 ** 63 - 1 - 64)  # int64, room for seed + choice
    if seed is not None:
        s["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise _type_error("stop", "a string or a list of strings", stop)
        if len(stops) > 16 or any(not x for x in stops):
            raise _value_error("stop", "at most 16 non-empty strings", stop)
        s["stop"] = tuple(_text(x, "stop") for x in stops)
    ignore_eos = body.get("ignore_eos")  # vLLM's extension: exact lengths for benchmarks
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise _type_error("ignore_eos", "a boolean", ignore_eos)
        s["ignore_eos"] = ignore_eos
    p.sampling = s
    return p


def parse_chat(body: dict[str, Any], max_n: int) -> ParsedRequest:
    _check_fields(body, CHAT_FIELDS)
    p = _parse_common(body, "chat", max_n)
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "Missing required parameter: 'messages'", "messages",
                       "missing_required_parameter")
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array of messages", msgs)
    if not msgs:
        raise ApiError(400, "'messages' must contain at least one message", "messages",
                       "invalid_value")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        role = m.get("role")
        if role not in ROLES:
            raise _value_error(f"{where}.role", f"must be one of {list(ROLES)}", role)
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ApiError(400, f"{where}.content[{j}]: only parts of type 'text' are "
                                        "supported", f"{where}.content", "unsupported_parameter")
                texts.append(_text(part.get("text"), f"{where}.content[{j}].text"))
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        else:
            content = _text(content, f"{where}.content")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": content}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = _text(m["tool_call_id"], f"{where}.tool_call_id")
        p.messages.append(msg)
    mt = _int(body, "max_tokens", 1)
    mct = _int(body, "max_completion_tokens", 1)
    p.max_tokens = mct if mct is not None else mt
    if mct is not None:
        p.max_tokens_param = "max_completion_tokens"
    lp = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not lp:
        raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", "top_logprobs",
                       "invalid_value")
    p.logprobs = (top or 0) if lp else None
    return p


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked: each a function with a name and JSON
    arguments."""
    if not isinstance(calls, list):
        raise _type_error(where, "an array of tool calls", calls)
    out = []
    for i, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise _value_error(f"{where}[{i}]", "must be {\"type\": \"function\", "
                               "\"function\": {\"name\", \"arguments\"}}", c)
        args = f.get("arguments") or "{}"
        try:
            json.loads(_text(args, f"{where}[{i}].function.arguments"))
        except json.JSONDecodeError:
            raise _value_error(f"{where}[{i}].function.arguments", "must be JSON text",
                               args) from None
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def parse_completion(body: dict[str, Any], max_n: int) -> ParsedRequest:
    _check_fields(body, COMPLETION_FIELDS)
    p = _parse_common(body, "completion", max_n)
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "Missing required parameter: 'prompt'", "prompt",
                       "missing_required_parameter")
    if isinstance(prompt, str):
        p.prompts = [_text(prompt, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        p.prompts = [_text(x, "prompt") for x in prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        p.prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in x) for x in prompt):
        p.prompts = [list(x) for x in prompt]
    else:
        raise _type_error("prompt", "a non-empty string, array of strings, array of token ids "
                          "or array of token id arrays", prompt)
    if len(p.prompts) * p.n > max_n:
        raise _value_error("n", f"{len(p.prompts)} prompts x n={p.n} choices exceeds the "
                           f"limit of {max_n} per request", p.n)
    p.max_tokens = _int(body, "max_tokens", 1)
    p.logprobs = _int(body, "logprobs", 0, 20)
    return p


def parse(kind: str, body: dict[str, Any], max_n: int) -> ParsedRequest:
    """A decoded body validated for `kind` ("chat" | "completion")."""
    # imported here: both modules raise this module's ApiError
    from xlaserve.serving.http.structured import parse_constraint
    from xlaserve.serving.http.tools import parse_tools, tool_constraint

    p = parse_chat(body, max_n) if kind == "chat" else parse_completion(body, max_n)
    p.constraint, p.constraint_param = parse_constraint(body)
    if kind == "chat":
        p.tools = parse_tools(body)
        forced = tool_constraint(p.tools) if p.tools is not None else None
        if forced is not None:
            if p.constraint is not None:
                raise ApiError(400, f"'{p.constraint_param}' cannot be combined with "
                                    f"tool_choice {p.tools.choice!r}", p.constraint_param,
                               "invalid_value")
            p.constraint, p.constraint_param = forced, "tools"
    return p
