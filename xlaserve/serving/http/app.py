"""The OpenAI-compatible HTTP API: the Quart app, its routes, hooks and error handlers.  A
generation request runs `pipeline.generate` (its stages in order, down to the JSON or SSE
response); an ApiError from any stage is answered by `api_error`.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health (alive),
GET /ready (engines warm), GET /metrics (Prometheus), GET /openapi.json (the API's OpenAPI 3.1
document, http/openapi.py), GET / (a minimal chat page).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quart import Quart, Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from xlaserve.serving.gateway.tracing import TraceContext
from xlaserve.serving.http.openapi import openapi_document
from xlaserve.serving.http.pipeline import authenticate, generate, refuse_if_draining
from xlaserve.serving.http.errors import ApiError
from xlaserve.serving.http.render import error_response, json_response
from xlaserve.serving.http.state import ServingState
from xlaserve.serving.router import RoutingError

CHAT_PAGE = Path(__file__).with_name("chat.html")


def create_app(state: ServingState) -> Quart:
    """The app serving `state`; its handlers find it as `current_app.extensions["xlaserve"]`."""
    app = Quart(__name__)
    app.config["MAX_CONTENT_LENGTH"] = state.config.max_body_bytes
    app.config["BODY_TIMEOUT"] = 30
    app.config["JSON_SORT_KEYS"] = False
    app.extensions["xlaserve"] = state
    app.before_serving(start_engines)
    app.after_serving(stop_engines)
    app.before_request(begin_trace)
    app.after_request(add_headers)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(ApiError, api_error)
    app.register_error_handler(Exception, server_error)
    for rule, view in (("/health", health), ("/ready", ready), ("/metrics", metrics),
                       ("/", chat_page), ("/v1/models", models), ("/openapi.json", openapi)):
        app.get(rule)(view)
    app.post("/v1/chat/completions", defaults={"kind": "chat"})(generation)
    app.post("/v1/completions", defaults={"kind": "completion"})(generation)
    return app


def serving_state() -> ServingState:
    state: ServingState = current_app.extensions["xlaserve"]
    return state


async def generation(kind: str) -> Response:
    state = serving_state()
    span = state.telemetry.request_span(g.trace, request.method, request.path)
    g.trace = state.telemetry.adopt(g.trace, span)   # a trace begun here: its ids everywhere
    return await generate(state, kind, request, g.trace, g.extra_headers, span)


async def models() -> Response:
    """The models this token may use ("auto" always listed)."""
    state = serving_state()
    refuse_if_draining(state)
    principal = authenticate(state, request.headers.get("Authorization"))
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
    return json_response({"object": "list", "data": data})


async def health() -> Response:
    return json_response({"status": "ok"})


async def ready() -> Response:
    state = serving_state()
    models = {grp.id: grp.ready for grp in state.router.groups}
    return json_response({"ready": state.ready, "models": models}, 200 if state.ready else 503)


async def metrics() -> Response:
    state = serving_state()
    state.update_admission_gauges()
    return Response(state.metrics.render(), mimetype="text/plain; version=0.0.4")


async def openapi() -> Response:
    return json_response(openapi_document())


async def chat_page() -> Response:
    return Response(CHAT_PAGE.read_text(), mimetype="text/html")


async def start_engines() -> None:
    await call_engines("start")  # RemoteEngine's channel is bound to the serving loop


async def stop_engines() -> None:
    await call_engines("stop")
    serving_state().telemetry.shutdown()   # flush the spans still batched


async def call_engines(method: str) -> None:
    """Await `method` of every engine that has it."""
    for grp in serving_state().router.groups:
        for r in grp.replicas:
            call = getattr(r.engine, method, None)
            if call is not None:
                await call()


async def begin_trace() -> None:
    g.trace = TraceContext.from_headers(request.headers.get("x-request-id"),
                                        request.headers.get("traceparent"))
    g.extra_headers = {}


async def add_headers(response: Response) -> Response:
    """Every response: the trace ids, the headers a stage left in `g.extra_headers`, and one
    count in the HTTP metric."""
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
    serving_state().metrics.http.labels(endpoint, str(response.status_code)).inc()
    return response


async def http_error(e: HTTPException) -> Response:
    return error_response(ApiError.from_http(e, serving_state().config.max_body_bytes))


async def api_error(e: ApiError) -> Response:
    return error_response(e)


async def server_error(e: Exception) -> Response:
    current_app.logger.exception("unhandled error")
    return error_response(ApiError(500, f"internal error: {type(e).__name__}", None,
                                   "internal_error"))
