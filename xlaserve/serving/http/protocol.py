"""A request body -> `ParsedRequest`; every failure an `ApiError` (http/errors.py).

The fields' types, ranges and policies are the pydantic models of http/schemas.py; `parse`
validates a body with them and answers the first failure as an ApiError (400) naming the
offending field in `param` (`messages[0].content`), with OpenAI's codes: invalid_type,
invalid_value, missing_required_parameter, unrecognized_argument, unsupported_parameter.  The
rules that depend on the server (n against `server.max_n`) or on two fields (stream_options
needs stream, top_logprobs needs logprobs) are checked here, after the models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from pydantic import BaseModel, ValidationError

from xlaserve.serving.http import schemas
from xlaserve.serving.http.errors import ApiError, invalid_value
from xlaserve.serving.http.schemas import (ChatCompletionRequest, CommonRequest,
                                           CompletionRequest, encodes)
from xlaserve.serving.http.structured import parse_constraint
from xlaserve.serving.http.tools import Tools, parse_tools, tool_constraint
from xlaserve.serving.structured.constraint import Constraint


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
    tokens_as_ids: bool = False       # logprobs name tokens "token_id:<id>" (vLLM's option)
    user: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs
    constraint: Constraint | None = None   # what the output must match (http/structured.py)
    constraint_param: str | None = None    # the field that set it, for errors
    tools: Tools | None = None             # chat: the tools offered (http/tools.py)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat: for the template


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


# -- validation errors -> ApiError --------------------------------------------------------------

_WANTS = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
          "string_type": "a string", "list_type": "an array", "dict_type": "an object",
          "model_type": "an object", "model_attributes_type": "an object"}
_PARAM_WANTS = {"messages": "an array of messages", "tool_calls": "an array of tool calls"}
_RANGES = ("greater_than", "greater_than_equal", "less_than", "less_than_equal",
           "finite_number")


def _type_error(name: str, want: str, value: Any) -> ApiError:
    return ApiError(400, f"Invalid type for '{name}': expected {want}, got "
                         f"{type(value).__name__} ({_show(value)})", name, "invalid_type")


def _value_error(name: str, why: str, value: Any) -> ApiError:
    return invalid_value(name, f"{why} (got {_show(value)})")


def _show(value: Any) -> str:
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError, RecursionError):
        return type(value).__name__


def _param(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _range(model: type[BaseModel], name: str) -> str:
    """A field's range as its errors say it ("must be between 1 and 20", "must be >= 1",
    "must be in (0, 1]"), read from the model's JSON schema, the one /openapi.json publishes."""
    prop = _properties(model)[name]
    s = next((b for b in prop.get("anyOf", [prop]) if b.get("type") in ("integer", "number")),
             {})
    lo_open = "exclusiveMinimum" in s
    lo, hi = s.get("exclusiveMinimum", s.get("minimum")), s.get("maximum")
    if s.get("type") == "number":
        return f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    return f"must be between {lo} and {hi}" if hi is not None else f"must be >= {lo}"


@cache
def _properties(model: type[BaseModel]) -> dict[str, Any]:
    props: dict[str, Any] = model.model_json_schema()["properties"]
    return props


def api_error(e: ValidationError, model: type[BaseModel]) -> ApiError:
    """The first of a body's validation errors (an unknown or unsupported field before any
    other, as OpenAI answers) as the ApiError the client gets."""
    errors = e.errors()
    err = min(errors, key=lambda x: x["type"] not in ("extra_forbidden", "unsupported_parameter")
              or len(x["loc"]) != 1)
    loc, kind, value = err["loc"], err["type"], err.get("input")
    name, ctx = _param(loc), err.get("ctx") or {}
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{name}'", name,
                        "missing_required_parameter")
    if kind == "extra_forbidden":
        if len(loc) > 1:
            parent = _param(loc[:-1])
            return ApiError(400, f"Unrecognized {parent} field(s): {[loc[-1]]}", parent,
                            "unrecognized_argument")
        return ApiError(400, f"Unrecognized request argument supplied: {name}", name,
                        "unrecognized_argument")
    if kind == "unsupported_parameter":
        return ApiError(400, f"'{name}': {err['msg']}", name, "unsupported_parameter")
    if kind == "invalid_text":
        return ApiError(400, f"'{name}' is not valid UTF-8 text (lone surrogate)", name,
                        "invalid_value")
    if kind == "invalid_type" or kind in _WANTS:
        want = ctx.get("want") or _PARAM_WANTS.get(str(loc[-1])) or _WANTS[kind]
        return _type_error(name, want, value)
    if kind in _RANGES and len(loc) == 1:
        return _value_error(name, _range(model, name), value)
    if kind == "string_too_short":
        return _value_error(name, "must not be empty", value)
    if kind == "too_short":
        return _value_error(name, f"must have at least {ctx.get('min_length', 1)} item(s)",
                            value)
    if kind == "literal_error":
        return _value_error(name, f"must be one of {ctx['expected']}", value)
    if not name:   # about the body as a whole (a nested key pydantic cannot read, say)
        return ApiError(400, f"Invalid request body: {err['msg']}", None, "invalid_value")
    return _value_error(name, err["msg"], value)


# -- a validated body -> ParsedRequest -------------------------------------------------------

def parse(kind: str, body: dict[str, Any], max_n: int) -> ParsedRequest:
    """A decoded body validated for `kind` ("chat" | "completion")."""
    model = schemas.REQUESTS[kind]
    for k in body:   # a key with no UTF-8 form (a lone surrogate) names no field we know
        if not encodes(k):
            raise ApiError(400, f"Unrecognized request argument supplied: {k}", k,
                           "unrecognized_argument")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise api_error(e, model) from None
    p = _common(req, kind, max_n)
    if isinstance(req, ChatCompletionRequest):
        _chat(req, p)
    else:
        assert isinstance(req, CompletionRequest)
        _completion(req, p, max_n)
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


def _common(req: CommonRequest, kind: str, max_n: int) -> ParsedRequest:
    p = ParsedRequest(kind, req.model, n=req.n or 1, stream=bool(req.stream),
                      priority=req.priority or 0, user=req.user,
                      speculative=req.speculative is not False,
                      tokens_as_ids=bool(req.return_tokens_as_token_ids))
    if p.n > max_n:
        raise _value_error("n", f"must be between 1 and {max_n}", p.n)
    if req.stream_options is not None:
        if not p.stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true",
                           "stream_options", "invalid_value")
        p.include_usage = bool(req.stream_options.include_usage)
    s: dict[str, Any] = {name: getattr(req, name) for name in (
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "seed",
        "ignore_eos") if getattr(req, name) is not None}
    if req.top_k is not None:
        s["top_k"] = max(req.top_k, 0)  # -1 (vLLM) and 0 both mean off
    if req.stop is not None:
        s["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    p.sampling = s
    return p


# what the server itself passes to a chat template
_TEMPLATE_OWN = ("messages", "tools", "documents", "add_generation_prompt")


def _chat(req: ChatCompletionRequest, p: ParsedRequest) -> None:
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": m.content}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments or "{}"}}
                for c in m.tool_calls]
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.role == "assistant" and m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        p.messages.append(msg)
    for k in req.chat_template_kwargs or {}:
        if k in _TEMPLATE_OWN:
            raise _value_error(f"chat_template_kwargs.{k}", "is set by the server, not by "
                               "chat_template_kwargs", req.chat_template_kwargs[k])
    p.chat_template_kwargs = dict(req.chat_template_kwargs or {})
    p.max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                    else req.max_tokens)
    if req.max_completion_tokens is not None:
        p.max_tokens_param = "max_completion_tokens"
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", "top_logprobs",
                       "invalid_value")
    p.logprobs = (req.top_logprobs or 0) if req.logprobs else None


def _completion(req: CompletionRequest, p: ParsedRequest, max_n: int) -> None:
    prompt = req.prompt
    if isinstance(prompt, str):
        p.prompts = [prompt]
    elif all(isinstance(x, int) for x in prompt):
        p.prompts = [list(prompt)]
    else:
        p.prompts = list(prompt)
    if len(p.prompts) * p.n > max_n:
        raise _value_error("n", f"{len(p.prompts)} prompts x n={p.n} choices exceeds the "
                           f"limit of {max_n} per request", p.n)
    p.max_tokens = req.max_tokens
    p.logprobs = req.logprobs
