"""The OpenAPI 3.1 document served at GET /openapi.json: the request models of http/schemas.py
and the response bodies below, as render.py writes them (tests/serving/http/test_openapi.py
validates real responses against these models, so the document cannot drift from the server).
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from xlaserve.serving.http.schemas import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Body):
    """Every 4xx and 5xx (and an error event in a stream)."""
    error: ErrorDetail


class PromptTokensDetails(_Body):
    cached_tokens: int    # prompt tokens served from the prefix cache


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ResponseFunctionCall(_Body):
    name: str
    arguments: str        # JSON text


class ResponseToolCall(_Body):
    id: str
    type: Literal["function"]
    function: ResponseFunctionCall


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None   # a reasoning model's thinking (vLLM's field)
    tool_calls: list[ResponseToolCall] | None = None


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]


FinishReason = Literal["stop", "length", "tool_calls", "error", "abort"] | None


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(_Body):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str]     # {"name", "arguments": ""} then {"arguments": JSON text}


class Delta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Body):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(_Body):
    """One `data:` event of a streamed chat completion (text/event-stream)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None   # present with stream_options.include_usage (null but last)


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(_Body):
    """A completion, and (streamed) each `data:` event of one."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": d, "content": {"application/json": {
        "schema": _ref(ErrorResponse)}}} for s, d in (
        (400, "Invalid request (param names the field)"), (401, "Missing or bad token"),
        (403, "Model not allowed for this token"), (404, "No such model"),
        (413, "Body over server.max_body_bytes"),
        (429, "Rate limit, quota or overload (Retry-After)"), (500, "Internal error"),
        (503, "Warming up or shutting down (Retry-After)")) if s in statuses}


def _generation(summary: str, request: type[BaseModel], response: type[BaseModel],
                chunk: type[BaseModel]) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": _ref(request)}}},
        "responses": {"200": {"description": "The answer; with stream: true, server-sent "
                                             f"events each a {chunk.__name__}, then "
                                             "data: [DONE]",
                              "content": {"application/json": {"schema": _ref(response)},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **_errors(400, 401, 403, 404, 413, 429, 500, 503)}}}


def _plain(summary: str, mimetype: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {
        "description": summary, "content": {mimetype: {"schema": {}}}}}}}


@cache
def openapi_document() -> dict[str, Any]:
    """The document (built once: it depends on the code only)."""
    models = (ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk,
              Completion, ModelList, ErrorResponse)
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    models_path = {"get": {"summary": "The models this token may use", "security": [
        {"bearer": []}], "responses": {"200": {"description": "The models", "content": {
            "application/json": {"schema": _ref(ModelList)}}}, **_errors(401, 503)}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "xlaserve", "version": "0.1.0",
                 "description": "OpenAI-compatible LLM inference server on JAX/XLA"},
        "paths": {
            "/v1/chat/completions": _generation("Chat completion", ChatCompletionRequest,
                                                ChatCompletion, ChatCompletionChunk),
            "/v1/completions": _generation("Text completion", CompletionRequest, Completion,
                                           Completion),
            "/v1/models": models_path,
            "/health": _plain("Alive"),
            "/ready": _plain("Engines warm (503 until they are)"),
            "/metrics": _plain("Prometheus metrics", "text/plain"),
        },
        "components": {"schemas": defs.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "bearerFormat": "JWT"}}},
    }
