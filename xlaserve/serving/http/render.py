"""A Generation's events as an OpenAI response: `full_response` collects them into one JSON body;
`stream_response` sends SSE chunks as they come (a role chunk first for chat), then any error of
`failure(gen)` as one event, a usage chunk if asked for, and [DONE].  Either closes the
Generation when it ends (`Generation.close()`), after `ended_by` set the status of one ended by
an exception (499 client gone, 500 otherwise)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from quart import Response

from xlaserve.serving.gateway.audit import utf8_json
from xlaserve.serving.http.chat_output import (ChatOutputParser, Parsed, chat_parser,
                                               message_body)
from xlaserve.serving.http.errors import ApiError
from xlaserve.serving.http.generation import Choice, Generation
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import EngineEvent, TokenLogprob, Usage


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> Response:
    return Response(utf8_json(body), status=status, headers=headers,
                    mimetype="application/json")


def error_response(e: ApiError) -> Response:
    return json_response(e.body(), e.status, e.headers)


def shutting_down(message: str) -> ApiError:
    """What a request refused or stopped by the shutdown drain answers."""
    return ApiError(503, message, None, "server_shutting_down", {"Retry-After": "5"})


def ended_by(e: BaseException) -> tuple[int, str]:
    """(status, code) for the audit line of a request ended by an exception that is not
    an ApiError: 499 when the client went away (its task was cancelled, or its stream
    closed), else 500 (the server failed)."""
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return 499, "client_disconnected"
    return 500, "internal_error"


def failure(gen: Generation) -> ApiError | None:
    """Once every choice ended: an engine failure or an abort we did not ask for becomes a 5xx
    (not the client's fault: `gen.status` is set, so nothing is charged); None if all finished."""
    if gen.stopped is not None and any(c.finish_reason == "abort" for c in gen.choices):
        gen.status = 503
        return shutting_down(gen.stopped)
    for c in gen.choices:
        if c.finish_reason == "error":
            gen.status = 500
            return ApiError(500, f"engine error: {c.error}", None, "engine_error")
        if c.finish_reason == "abort":
            gen.status = 503
            return ApiError(503, "the request was aborted by the engine", None, "aborted")
    return None


async def render(gen: Generation) -> Response:
    return stream_response(gen) if gen.admitted.parsed.stream else await full_response(gen)


async def full_response(gen: Generation) -> Response:
    parsed = gen.admitted.parsed
    lps: dict[int, list[TokenLogprob]] = {c.index: [] for c in gen.choices}
    try:
        async for c, ev in gen.events():
            lps[c.index].extend(ev.logprobs)
        err = failure(gen)
    except BaseException as e:
        gen.status = ended_by(e)[0]  # close() aborts the engine requests
        raise
    finally:
        await gen.close()
    if err is not None:
        return error_response(err)
    choices = []
    for c in gen.choices:
        lp = logprobs_body(gen, lps[c.index], 0)
        if parsed.kind == "chat":
            message = message_body(chat_parser_of(gen, c), c.text)
            reason = c.finish_reason
            if "tool_calls" in message and reason == "stop":
                reason = "tool_calls"
            choices.append({"index": c.index, "message": message,
                            "logprobs": lp, "finish_reason": reason})
        else:
            choices.append({"index": c.index, "text": c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
    return json_response({
        "id": response_id(gen), "object": "chat.completion" if parsed.kind == "chat"
        else "text_completion", "created": int(time.time()), "model": gen.group.id,
        "choices": choices, "usage": usage_dict(gen.usage())})


def stream_response(gen: Generation) -> Response:
    parsed = gen.admitted.parsed
    rid, created, model = response_id(gen), int(time.time()), gen.group.id
    chat = parsed.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    offsets = {c.index: 0 for c in gen.choices}
    parsers = {c.index: chat_parser_of(gen, c) if chat else None for c in gen.choices}

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                "model": model, "choices": choices}
        if parsed.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def piece(c: Choice, ev: EngineEvent) -> dict[str, Any]:
        lp = logprobs_body(gen, ev.logprobs, offsets[c.index])
        offsets[c.index] += len(ev.text)
        fr = ev.finish_reason if ev.finish_reason in ("stop", "length") else None
        if chat:
            return {"index": c.index, "delta": {"content": ev.text} if ev.text else {},
                    "logprobs": lp, "finish_reason": fr}
        return {"index": c.index, "text": ev.text, "logprobs": lp, "finish_reason": fr}

    async def sse() -> AsyncIterator[str]:
        try:
            if chat:
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for c in gen.choices])
            async for c, ev in gen.events():
                if ev.finish_reason in ("error", "abort"):
                    continue  # reported once, below, after every choice ended
                parser = parsers[c.index]
                if parser is not None:
                    for p in parsed_chunks(piece(c, ev), ev, parser):
                        yield chunk([p])
                elif ev.text or ev.finished or ev.logprobs:
                    yield chunk([piece(c, ev)])
            err = failure(gen)
            if err is not None:
                yield f"data: {json.dumps(err.body())}\n\n"
            if parsed.include_usage:
                yield chunk([], usage_dict(gen.usage()))
            yield "data: [DONE]\n\n"
        except BaseException as e:
            gen.status = ended_by(e)[0]
            raise
        finally:
            await gen.close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    response = Response(sse(), mimetype="text/event-stream", headers=headers)
    response.timeout = None  # a long generation is not a stuck response
    return response


def parsed_chunks(base: dict[str, Any], ev: EngineEvent, parser: ChatOutputParser
                  ) -> list[dict[str, Any]]:
    """A parsed chat choice's event (`base`: its plain chunk choice) as chunk choices: the
    reasoning and content the parser lets through (delta.reasoning_content, delta.content),
    per completed call its id and name then its arguments (OpenAI's delta.tool_calls, by call
    index), and the finish reason last (`tool_calls` for a choice that made calls and
    stopped)."""
    p = parser.feed(ev.text)
    if ev.finished:
        q = parser.finish()
        p = Parsed(p.reasoning + q.reasoning, p.content + q.content, p.calls + q.calls)
    i, fr = base["index"], base["finish_reason"]
    delta = {k: v for k, v in (("reasoning_content", p.reasoning), ("content", p.content)) if v}
    base.update(delta=delta, finish_reason=None)
    out = [base] if delta or ev.logprobs else []
    for k in p.calls:
        out.append({"index": i, "logprobs": None, "finish_reason": None, "delta": {
            "tool_calls": [{"index": k.index, "id": k.id, "type": "function",
                            "function": {"name": k.name, "arguments": ""}}]}})
        out.append({"index": i, "logprobs": None, "finish_reason": None, "delta": {
            "tool_calls": [{"index": k.index, "function": {"arguments": k.arguments}}]}})
    if fr is not None:
        out.append({"index": i, "delta": {}, "logprobs": None,
                    "finish_reason": "tool_calls" if parser.made_calls and fr == "stop" else fr})
    return out


def chat_parser_of(gen: Generation, c: Choice) -> ChatOutputParser | None:
    """The output parser of a chat choice (reasoning, tool calls; http/chat_output.py)."""
    return chat_parser(gen.group.tokenizer, gen.admitted.prompts[c.prompt_index],
                       gen.admitted.parsed.tools, f"call_{gen.admitted.trace.request_id}_{c.index}")


def response_id(gen: Generation) -> str:
    chat = gen.admitted.parsed.kind == "chat"
    return ("chatcmpl-" if chat else "cmpl-") + gen.admitted.trace.request_id


def usage_dict(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def logprobs_body(gen: Generation, entries: Sequence[TokenLogprob], offset: int
                  ) -> dict[str, Any] | None:
    """A choice's `logprobs` field (None when the client did not ask for it); `offset` is where
    the entries' text starts in the choice's text (a completion's text_offset)."""
    parsed, tok = gen.admitted.parsed, gen.group.tokenizer
    if parsed.logprobs is None:
        return None
    name = token_id_name if parsed.tokens_as_ids else None
    if parsed.kind == "chat":
        return chat_logprobs(entries, tok, name)
    return completion_logprobs(entries, tok, offset, name)


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def token_id_name(token_id: int) -> str:
    """A logprobs token as vLLM's `return_tokens_as_token_ids` writes it."""
    return f"token_id:{token_id}"


def chat_logprobs(entries: Sequence[TokenLogprob], tok: Tokenizer,
                  name: Callable[[int], str] | None = None) -> dict[str, Any]:
    """`bytes` are the token's own bytes (`Tokenizer.token_bytes`), so that a client can
    rebuild a character split over several tokens; `name` writes each token (default: its
    text)."""
    def one(tid: int, lp: float) -> dict[str, Any]:
        return {"token": name(tid) if name else token_text(tok, tid), "logprob": lp,
                "bytes": list(tok.token_bytes(tid))}

    return {"content": [{**one(e.token_id, e.logprob),
                         "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


def completion_logprobs(entries: Sequence[TokenLogprob], tok: Tokenizer, offset: int,
                        name: Callable[[int], str] | None = None) -> dict[str, Any]:
    """`name` writes each token (default: its text; the offsets count text either way)."""
    texts = [token_text(tok, e.token_id) for e in entries]
    tokens = [name(e.token_id) for e in entries] if name else texts
    starts = itertools.accumulate([offset, *map(len, texts)])   # where each token's text starts
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{name(i) if name else token_text(tok, i): lp for i, lp in e.top}
                             for e in entries],
            "text_offset": list(starts)[:len(tokens)]}
