"""The OpenAI request bodies as pydantic models: each field's type, range and policy in one
place, checked by `model_validate` (protocol.py turns a ValidationError into the ApiError the
client gets) and published by openapi.py as /openapi.json.

Strict types, as OpenAI's own server is: "5" is not an integer, true is not a number, 2.0 is
the integer 2.  Unknown fields are 400 "Unrecognized request argument supplied" (extra
"forbid"), except `user`, `metadata`, `store`, `service_tier`, declared and ignored; fields we
know but do not implement (`logit_bias`, `echo`, ...) are declared `default_only`: any other
value is a 400 saying so, so a client never silently gets other behaviour than it asked for.
Output constraints (`response_format`, `guided_*`, `structured_outputs`) and tools are declared
with their documented shapes but read by http/structured.py and http/tools.py, whose checks are
about meaning (one constraint per request, a schema's size, the tool named by tool_choice).

Custom error types raised here, read by protocol.py: `invalid_type` (ctx "want"),
`invalid_value` (ctx "why"), `unsupported_parameter`, `invalid_text`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError, ValidationInfo, WithJsonSchema, WrapValidator,
                      field_validator)
from pydantic_core import PydanticCustomError

from xlaserve.serving.types import MAX_INT32

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1 - 64   # int64, room for seed + choice index


# -- field types ------------------------------------------------------------------------------

def _integral(v: Any) -> Any:
    """2.0 -> 2 (JSON has one number type); other floats stay and fail the int check."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def encodes(text: str) -> bool:
    """Has `text` a UTF-8 form (JSON's \\ud800 escapes give lone surrogates, which have none)?"""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _utf8(v: str) -> str:
    if not encodes(v):
        raise PydanticCustomError("invalid_text", "not valid UTF-8 text (lone surrogate)")
    return v


def one_of(want: str) -> WrapValidator:
    """Any failure of the wrapped type (a union, say) is one `invalid_type` error at the
    field, "expected <want>", instead of one error per union branch."""
    def wrap(v: Any, handler: Any) -> Any:
        try:
            return handler(v)
        except ValidationError as e:
            if any(err["type"] == "invalid_text" for err in e.errors()):
                raise PydanticCustomError("invalid_text", "not valid UTF-8 text") from None
            raise PydanticCustomError("invalid_type", "expected {want}", {"want": want}
                                      ) from None
    return WrapValidator(wrap)


def default_only(*accepted: Any) -> Any:
    """A field accepted only at one of its default values (the behaviour implemented)."""
    def check(v: Any) -> Any:
        if v not in accepted:
            raise PydanticCustomError("unsupported_parameter",
                                      "not supported by this server (only its default is "
                                      "accepted)")
        return v
    return Annotated[Any, AfterValidator(check), WithJsonSchema({
        "enum": list(accepted), "description": "Not implemented: accepted at its default only"})]


def integer(description: str | None = None, **bounds: int) -> Any:
    """An optional integer field within `bounds` (ge=, le=), integral floats accepted."""
    return Annotated[Annotated[int, Field(**bounds), BeforeValidator(_integral)] | None,
                     Field(description=description)]


Text = Annotated[str, AfterValidator(_utf8)]
TokenIds = Annotated[list[int], Field(min_length=1)]   # ids checked against the vocabulary
                                                       # later (pipeline.tokenize)
Ignored = Annotated[Any, Field(description="Accepted and ignored")]


def _documented(schema: dict[str, Any], description: str) -> Any:
    """A field read by another module (structured.py, tools.py), published with its shape."""
    return Annotated[Any, WithJsonSchema({**schema, "description": description})]


_OBJECT = {"type": "object"}
_STRUCTURED = _documented(_OBJECT, "vLLM's structured_outputs: one of json, regex, choice, "
                          "grammar, json_object")
_RESPONSE_FORMAT = _documented({"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "json_object", "json_schema"]},
    "json_schema": {"type": "object", "properties": {
        "name": {"type": "string"}, "schema": {"type": "object"},
        "strict": {"type": "boolean"}}}}}, "Constrain the output to JSON (a schema)")
_TOOLS = _documented({"type": "array", "items": {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}},
    "Functions the model may call")
_TOOL_CHOICE = _documented({"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}}}}}]},
    "none | auto | required | a named function")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None
    continuous_usage_stats: Ignored = None


class TextPart(BaseModel):
    """A content part; only text is supported."""
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: Text | None = None    # JSON text; None / "" mean {}

    @field_validator("arguments")
    @classmethod
    def _json(cls, v: str | None) -> str | None:
        if v:
            try:
                json.loads(v)
            except json.JSONDecodeError:
                raise PydanticCustomError("invalid_value", "must be JSON text") from None
        return v


class ToolCall(BaseModel):
    """A call an earlier assistant message made (sent back with the tool's answer)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


def _content_required(schema: dict[str, Any]) -> None:
    """Published: content is required (an assistant message carrying tool_calls may leave it
    out or null; the document says the stricter rule every role keeps)."""
    schema["required"] = ["role", "content"]


class ChatMessage(BaseModel):
    """Unknown message fields (`name`, `refusal`, ...) are ignored, as OpenAI's are optional."""
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_content_required)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Text | list[dict[str, Any]] | None,
                       one_of("a string or an array of content parts"),
                       WithJsonSchema({"anyOf": [
                           {"type": "string"},
                           {"type": "array", "items": TextPart.model_json_schema()}]})
                       ] = Field(None, validate_default=True)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None   # an assistant's earlier reasoning (vLLM's field)

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | list[dict[str, Any]] | None, info: ValidationInfo
                 ) -> str | None:
        """-> the text (parts joined); None only for an assistant message (its tool calls)."""
        if v is None:
            if info.data.get("role") != "assistant":
                raise PydanticCustomError("invalid_type", "expected {want}",
                                          {"want": "a string"})
            return ""
        if isinstance(v, str):
            return v
        texts = []
        for j, part in enumerate(v):
            try:
                texts.append(TextPart.model_validate(part).text)
            except ValidationError as e:
                kinds = {err["type"] for err in e.errors()}
                if "invalid_text" in kinds:
                    raise PydanticCustomError("invalid_text", "not valid UTF-8 text") from None
                if isinstance(part, dict) and part.get("type") == "text":
                    raise PydanticCustomError("invalid_type", "expected {want}", {
                        "want": f"text parts whose content[{j}].text is a string"}) from None
                raise PydanticCustomError("unsupported_parameter",
                                          "content[{j}]: only parts of type 'text' are "
                                          "supported", {"j": j}) from None
        return "".join(texts)


class CommonRequest(BaseModel):
    """The fields both endpoints take, in the order they are checked (the first bad one is
    the one answered)."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: Annotated[Text, Field(min_length=1, description="A served model id, or 'auto'")]
    n: integer("Choices per prompt (at most server.max_n)", ge=1) = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: integer("Scheduling priority (ours): lower runs first", ge=-1000, le=1000) = None
    speculative: bool | None = Field(None, description="false: never verify draft tokens")
    user: Text | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    top_k: integer("-1 or 0: off", ge=-1, le=MAX_INT32) = None
    seed: integer(ge=SEED_MIN, le=SEED_MAX) = None
    stop: Annotated[Text | list[Text] | None, one_of("a string or a list of strings")] = None
    ignore_eos: bool | None = Field(None, description="vLLM's: run to max_tokens")
    return_tokens_as_token_ids: bool | None = Field(
        None, description="vLLM's: logprobs name each token 'token_id:<id>'")
    response_format: _RESPONSE_FORMAT = None
    guided_json: _documented({}, "vLLM's: a JSON schema (object or JSON text)") = None
    guided_regex: _documented({"type": "string", "minLength": 1},
                              "vLLM's: a regular expression") = None
    guided_choice: _documented({"type": "array", "minItems": 1, "items": {
        "type": "string", "minLength": 1}}, "vLLM's: one of these strings") = None
    guided_grammar: _documented({"type": "string", "minLength": 1},
                                "vLLM's: a Lark grammar") = None
    structured_outputs: _STRUCTURED = None
    metadata: Ignored = None
    store: Ignored = None
    service_tier: Ignored = None
    logit_bias: default_only(None, {}) = None
    functions: default_only(None, []) = None
    function_call: default_only(None, "none", "auto") = None
    modalities: default_only(None, ["text"]) = None
    prediction: default_only(None) = None
    audio: default_only(None) = None
    reasoning_effort: default_only(None) = None
    web_search_options: default_only(None) = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise PydanticCustomError("invalid_value", "at most {k} non-empty strings",
                                      {"k": MAX_STOPS})
        return v


class ChatCompletionRequest(CommonRequest):
    """POST /v1/chat/completions."""
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: integer(ge=1) = None
    max_completion_tokens: integer(ge=1) = None
    logprobs: bool | None = None
    top_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) = None
    tools: _TOOLS = None
    tool_choice: _TOOL_CHOICE = None
    parallel_tool_calls: _documented({"type": "boolean"}, "Several calls in one answer") = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: extra variables for the model's chat template, such as "
                          "Qwen3's enable_thinking")


class CompletionRequest(CommonRequest):
    """POST /v1/completions."""
    prompt: Annotated[Text | Annotated[list[Text], Field(min_length=1)] | TokenIds
                      | Annotated[list[TokenIds], Field(min_length=1)],
                      one_of("a non-empty string, array of strings, array of token ids or "
                             "array of token id arrays")]
    max_tokens: integer(ge=1) = None
    logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) = None
    echo: default_only(None, False) = None
    suffix: default_only(None, "") = None
    best_of: default_only(None, 1) = None


REQUESTS: dict[str, type[CommonRequest]] = {"chat": ChatCompletionRequest,
                                      "completion": CompletionRequest}
