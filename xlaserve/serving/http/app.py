"""The OpenAI-compatible HTTP API (Quart app factory).

One generation request, in order (each step can end it with an OpenAI-shaped error):

    trace ids (x-request-id, traceparent)  -> echoed on every response
    auth (JWT -> Principal)                -> 401
    rate limits / daily quota              -> 429 + Retry-After + x-ratelimit-*
    body: size, UTF-8, JSON, fields        -> 413 / 400 naming the field
    model -> group (router, tier, token)   -> 404 / 403;  "auto" picks small or large by length
    tokenize, context length check         -> 400 context_length_exceeded
    reserve prompt + n x max_tokens tokens -> 429 (tokens in flight count against the limits)
    admission (queue / SLO)                -> 429 + Retry-After
    Generation: n engine requests merged   -> JSON, or SSE chunks + [DONE]
    always: abort what is unfinished, release the slot, settle the reservation to the tokens
            served (none on a 5xx), metrics, audit line

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health (alive),
GET /ready (engines warm), GET /metrics (Prometheus), GET / (a minimal chat page).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from xlaserve.serving.admission import Rejected, Work
from xlaserve.serving.gateway.audit import utf8_json
from xlaserve.serving.gateway.auth import AuthError, Principal
from xlaserve.serving.gateway.ratelimit import RateLimited, Reservation
from xlaserve.serving.gateway.tracing import TraceContext
from xlaserve.serving.http.protocol import (
    ApiError,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    decode_body,
    parse_chat,
    parse_completion,
    usage_dict,
)
from xlaserve.serving.http.state import Admitted, Choice, Generation, ServingState, audit_record
from xlaserve.serving.router import ModelGroup, RoutingError
from xlaserve.serving.types import EngineEvent, SamplingParams, Usage

CHAT_PAGE = Path(__file__).with_name("chat.html")
ROUTED_HEADER = "x-xlaserve-routed-model"


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(utf8_json(body), status=status, headers=headers,
                    mimetype="application/json")


def create_app(state: ServingState) -> Quart:
    app = Quart(__name__)
    app.config["MAX_CONTENT_LENGTH"] = state.config.max_body_bytes
    app.config["BODY_TIMEOUT"] = 30
    app.config["JSON_SORT_KEYS"] = False
    app.extensions["xlaserve"] = state

    engines = [r.engine for grp in state.router.groups for r in grp.replicas]

    @app.before_serving
    async def _start_engines() -> None:
        # Engines with an event-loop-bound part (RemoteEngine's channel) start in this loop.
        for e in engines:
            start = getattr(e, "start", None)
            if start is not None:
                await start()

    @app.after_serving
    async def _stop_engines() -> None:
        for e in engines:
            stop = getattr(e, "stop", None)
            if stop is not None:
                await stop()

    @app.before_request
    async def _trace() -> None:
        g.trace = TraceContext.from_headers(request.headers.get("x-request-id"),
                                            request.headers.get("traceparent"))
        g.extra_headers = {}

    @app.after_request
    async def _headers(response: Response) -> Response:
        trace = getattr(g, "trace", None)
        if trace is not None:
            response.headers["x-request-id"] = trace.request_id
            response.headers["traceparent"] = trace.traceparent
        for k, v in getattr(g, "extra_headers", {}).items():
            response.headers.setdefault(k, v)
        # Label by the matched route, never the raw path: anyone can send any path, and each
        # distinct label value would be a new Prometheus series.
        rule = request.url_rule
        endpoint = ("unmatched" if rule is None
                    else rule.rule if rule.rule.startswith("/v1/") else "other")
        state.metrics.http.labels(endpoint, str(response.status_code)).inc()
        return response

    def shutting_down(message: str) -> ApiError:
        """What a request refused or stopped by the shutdown drain answers."""
        return ApiError(503, message, None, "server_shutting_down", {"Retry-After": "5"})

    def error_response(e: ApiError) -> Response:
        return _json(e.body(), e.status, e.headers)

    @app.errorhandler(HTTPException)
    async def _http_error(e: HTTPException) -> Response:
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(
            e.code or 400, None)
        msg = (f"Request body exceeds the limit of {state.config.max_body_bytes} bytes"
               if e.code == 413 else e.description or e.name)
        return error_response(ApiError(e.code or 400, msg, None, code))

    @app.errorhandler(Exception)
    async def _server_error(e: Exception) -> Response:
        app.logger.exception("unhandled error")
        return error_response(ApiError(500, f"internal error: {type(e).__name__}", None,
                                       "internal_error"))

    def authenticate() -> Principal:
        try:
            return state.auth.authenticate(request.headers.get("Authorization"))
        except AuthError as e:
            state.metrics.rejections.labels("auth").inc()
            raise ApiError(401, str(e), None, "invalid_api_key",
                           {"WWW-Authenticate": 'Bearer realm="xlaserve"'}) from None

    # -- simple routes ---------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        models = {g.id: g.ready for g in state.router.groups}
        return _json({"ready": state.ready, "models": models}, 200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.update_admission_gauges()
        return Response(state.metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.get("/")
    async def chat_page() -> Response:
        return Response(CHAT_PAGE.read_text(), mimetype="text/html")

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            if state.draining:
                raise shutting_down("server shutting down")
            principal = authenticate()
        except ApiError as e:
            return error_response(e)
        data = []
        for mid in state.router.model_ids():
            entry: dict[str, Any] = {"id": mid, "object": "model", "created": 0,
                                     "owned_by": "xlaserve"}
            if mid != "auto":
                try:
                    grp = state.router.resolve(mid, principal.tier)
                except RoutingError:
                    continue
                if not principal.may_use(grp.name):
                    continue
                entry.update(root=grp.id, max_model_len=grp.max_model_len)
            data.append(entry)
        return _json({"object": "list", "data": data})

    # -- generation ------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate("chat")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate("completion")

    async def generate(kind: str) -> Response:
        arrived = time.monotonic()
        trace: TraceContext = g.trace
        principal: Principal | None = None
        model: str | None = None
        reservation: Reservation | None = None
        try:
            if state.draining:
                raise shutting_down("server shutting down")
            principal = authenticate()
            try:
                g.extra_headers.update(state.limiter.check(principal.tenant, principal.tier))
            except RateLimited as e:
                raise rate_limited(e) from None
            try:
                raw = await request.get_data(cache=False, as_text=False)
            except HTTPException as e:
                raise ApiError(e.code or 400, f"Request body exceeds the limit of "
                               f"{state.config.max_body_bytes} bytes" if e.code == 413
                               else str(e.description), None,
                               "request_too_large" if e.code == 413 else None) from None
            body = decode_body(raw if isinstance(raw, bytes) else raw.encode())
            model = body.get("model") if isinstance(body.get("model"), str) else None
            max_n = state.config.max_n
            parsed = parse_chat(body, max_n) if kind == "chat" else parse_completion(body, max_n)
            group, prompts = route(parsed, principal)
            model = group.id
            sampling = sampling_params(parsed, group, prompts)
            try:  # hold the most it can use, so that requests in flight together cannot
                # overshoot the tenant's limits (gateway/ratelimit.py)
                reservation = state.limiter.reserve(
                    principal.tenant, principal.tier,
                    sum(len(p) for p in prompts) + len(prompts) * parsed.n * sampling.max_tokens)
            except RateLimited as e:
                raise rate_limited(e) from None
            if not group.ready:
                raise ApiError(503, f"model {group.id!r} is still warming up", None,
                               "model_not_ready", {"Retry-After": "5"})
            try:
                work = Work(sum(len(p) for p in prompts) // len(prompts), sampling.max_tokens)
                ticket = await group.admission.acquire(principal.tier, parsed.priority,
                                                       len(prompts) * parsed.n, work)
            except Rejected as e:
                state.metrics.rejections.labels(e.reason).inc()
                raise ApiError(429, f"server overloaded: {e}", None, f"overloaded_{e.reason}",
                               {"Retry-After": str(int(e.retry_after))}) from None
        except ApiError as e:
            if e.status == 400:
                state.metrics.rejections.labels("invalid_request").inc()
            if reservation is not None:
                state.limiter.settle(reservation, 0)
            audit_unserved(arrived, principal, model, e.status, e.code)
            return error_response(e)
        except BaseException as e:
            # The client went away (queued in admission, say) or a bug: still one audit line.
            if reservation is not None:
                state.limiter.settle(reservation, 0)
            audit_unserved(arrived, principal, model, *ended_by(e))
            raise
        if parsed.model == "auto":
            g.extra_headers[ROUTED_HEADER] = group.id
        try:
            gen = Generation(state, Admitted(
                trace=trace, endpoint=request.path, arrived=arrived, principal=principal,
                parsed=parsed, group=group, prompts=prompts, sampling=sampling,
                reservation=reservation, ticket=ticket))
        except BaseException as e:
            group.admission.release(ticket)
            state.limiter.settle(reservation, 0)
            audit_unserved(arrived, principal, model, *ended_by(e))
            raise
        # Safety net: a client gone before a streamed body starts never runs the generator's
        # `finally`; when this request's task ends, close whatever is still open.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: _close_orphan(gen))
        if parsed.stream:
            return stream_response(gen, parsed)
        return await full_response(gen, parsed)

    def rate_limited(e: RateLimited) -> ApiError:
        state.metrics.rejections.labels(e.code).inc()
        return ApiError(429, str(e), None, e.code, {
            **e.headers, "Retry-After": str(max(1, math.ceil(e.retry_after)))})

    def ended_by(e: BaseException) -> tuple[int, str]:
        """(status, code) for the audit line of a request ended by an exception that is not
        an ApiError: 499 when the client went away (its task was cancelled, or its stream
        closed), else 500 (the server failed)."""
        if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
            return 499, "client_disconnected"
        return 500, "internal_error"

    def audit_unserved(arrived: float, principal: Principal | None, model: str | None,
                       status: int, code: str | None) -> None:
        """The audit line of a request that ended before its Generation existed."""
        if state.audit is None:
            return
        state.audit.write({**audit_record(g.trace, principal, model, request.path, status,
                                          Usage(0, 0), time.monotonic() - arrived),
                           "error": code})

    def _close_orphan(gen: Generation) -> None:
        if not gen.closed:
            gen.status = 499
            state.spawn(gen.close())

    def route(parsed: ParsedRequest, principal: Principal) -> tuple[ModelGroup, list[list[int]]]:
        try:
            group = state.router.resolve(parsed.model, principal.tier)
            if not principal.may_use(group.name):
                raise RoutingError(403, f"your token may not use the model {parsed.model!r}",
                                   "model_not_allowed")
            prompts = tokenize(parsed, group)
            if parsed.model == "auto":
                chosen = state.router.choose_auto(len(prompts[0]), principal.tier)
                if chosen is not group and principal.may_use(chosen.name):
                    group, prompts = chosen, tokenize(parsed, chosen)
        except RoutingError as e:
            raise ApiError(e.status, str(e), "model", e.code) from None
        return group, prompts

    def tokenize(parsed: ParsedRequest, group: ModelGroup) -> list[list[int]]:
        tok = group.tokenizer
        if parsed.kind == "chat":
            try:
                return [tok.encode_chat(parsed.messages)]
            except Exception as e:  # noqa: BLE001 (any template error, raise_exception too)
                raise ApiError(400, f"could not apply the chat template: {e}", "messages",
                               "invalid_value") from None
        out = []
        vocab = tok.vocab_size
        for p in parsed.prompts:
            if isinstance(p, str):
                ids = tok.encode(p)
                if not ids:
                    raise ApiError(400, "'prompt' encodes to no tokens", "prompt",
                                   "invalid_value")
            else:
                bad = [t for t in p if not 0 <= t < vocab]
                if bad:
                    raise ApiError(400, f"'prompt' has token ids outside [0, {vocab}): "
                                        f"{bad[:5]}", "prompt", "invalid_value")
                ids = p
            out.append(ids)
        return out

    def sampling_params(parsed: ParsedRequest, group: ModelGroup, prompts: list[list[int]]
                        ) -> SamplingParams:
        limit = group.max_model_len
        field = "messages" if parsed.kind == "chat" else "prompt"
        longest = max(len(p) for p in prompts)
        if longest >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the "
                                f"prompt has {longest} tokens", field,
                           "context_length_exceeded")
        room = limit - longest
        if parsed.max_tokens is None:
            max_tokens = room if parsed.kind == "chat" else min(16, room)
        elif parsed.max_tokens > room:
            name = parsed.max_tokens_param
            raise ApiError(400, f"'{name}' is too large: {parsed.max_tokens} > {room} (this "
                                f"model's maximum context length is {limit} tokens and the "
                                f"prompt has {longest})", name, "context_length_exceeded")
        else:
            max_tokens = parsed.max_tokens
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=parsed.logprobs,
                                  **parsed.sampling)
        except ValueError as e:
            param = str(e).split("=", 1)[0] if "=" in str(e) else None
            raise ApiError(400, str(e), param, "invalid_value") from None

    # -- responses -------------------------------------------------------------------------

    def token_text(group: ModelGroup) -> Any:
        return lambda tid: group.tokenizer.decode([tid], skip_special_tokens=False)

    def settle_status(gen: Generation) -> ApiError | None:
        """An engine failure or an abort we did not ask for becomes a 5xx (not the client's
        fault); finished choices are fine."""
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

    async def full_response(gen: Generation, parsed: ParsedRequest) -> Response:
        lps: dict[int, list[Any]] = {c.index: [] for c in gen.choices}
        try:
            async for c, ev in gen.events():
                lps[c.index].extend(ev.logprobs)
            err = settle_status(gen)
        except BaseException as e:
            gen.status = ended_by(e)[0]  # close() aborts the engine requests
            raise
        finally:
            await gen.close()
        if err is not None:
            return error_response(err)
        u = gen.usage()
        tt = token_text(gen.group)
        choices = []
        for c in gen.choices:
            if parsed.kind == "chat":
                choices.append({"index": c.index,
                                "message": {"role": "assistant", "content": c.text},
                                "logprobs": chat_logprobs(lps[c.index], tt,
                                                          gen.group.tokenizer.token_bytes)
                                if parsed.logprobs is not None else None,
                                "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text,
                                "logprobs": completion_logprobs(lps[c.index], tt, 0)
                                if parsed.logprobs is not None else None,
                                "finish_reason": c.finish_reason})
        body = {"id": response_id(gen, parsed), "object": "chat.completion"
                if parsed.kind == "chat" else "text_completion", "created": int(time.time()),
                "model": gen.group.id, "choices": choices,
                "usage": usage_dict(u.prompt_tokens, u.completion_tokens, u.cached_tokens)}
        return _json(body)

    def response_id(gen: Generation, parsed: ParsedRequest) -> str:
        return ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + gen.admitted.trace.request_id

    def stream_response(gen: Generation, parsed: ParsedRequest) -> Response:
        rid, created, model = response_id(gen, parsed), int(time.time()), gen.group.id
        chat = parsed.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        tt = token_text(gen.group)
        offsets = {c.index: 0 for c in gen.choices}

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            body: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                    "model": model, "choices": choices}
            if parsed.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def piece(c: Choice, ev: EngineEvent) -> dict[str, Any]:
            lp = None
            if parsed.logprobs is not None:
                lp = chat_logprobs(list(ev.logprobs), tt, gen.group.tokenizer.token_bytes) \
                    if chat else \
                    completion_logprobs(list(ev.logprobs), tt, offsets[c.index])
            offsets[c.index] += len(ev.text)
            fr = ev.finish_reason if ev.finish_reason in ("stop", "length") else None
            if chat:
                return {"index": c.index, "delta": {"content": ev.text} if ev.text else {},
                        "logprobs": lp, "finish_reason": fr}
            return {"index": c.index, "text": ev.text, "logprobs": lp, "finish_reason": fr}

        async def sse() -> Any:
            try:
                if chat:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant",
                                                              "content": ""},
                                  "logprobs": None, "finish_reason": None}
                                 for c in gen.choices])
                async for c, ev in gen.events():
                    if ev.finish_reason in ("error", "abort"):
                        continue  # reported once, below, after every choice ended
                    if ev.text or ev.finished or ev.logprobs:
                        yield chunk([piece(c, ev)])
                err = settle_status(gen)
                if err is not None:
                    yield f"data: {json.dumps(err.body())}\n\n"
                if parsed.include_usage:
                    u = gen.usage()
                    yield chunk([], usage_dict(u.prompt_tokens, u.completion_tokens,
                                               u.cached_tokens))
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

    return app

