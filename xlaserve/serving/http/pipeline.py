"""A generation request's stages, and `generate`, which calls them in order (the order of
docs/architecture.md's request lifecycle).  Each stage returns what the next needs or raises the
ApiError the client gets (the app's handler answers it).  Until the Generation exists, the
`Intake` around the stages ends a failed request unserved (reservation settled to 0, one audit
line); from then on `Generation.close()` does, when the response ends or, for a client gone
before its stream started, when its task ends.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from types import TracebackType

from opentelemetry.trace import INVALID_SPAN, Span
from quart import Request, Response
from werkzeug.exceptions import HTTPException

from xlaserve.serving.admission import Rejected, Ticket, Work
from xlaserve.serving.gateway.auth import AuthError, Principal
from xlaserve.serving.gateway.ratelimit import RateLimited, Reservation
from xlaserve.serving.gateway.tracing import TraceContext
from xlaserve.serving.http.errors import ApiError
from xlaserve.serving.http.protocol import ParsedRequest, decode_body, parse
from xlaserve.serving.http.render import ended_by, render, shutting_down
from xlaserve.serving.http.generation import Admitted, Generation, audit_record
from xlaserve.serving.http.state import ServingState
from xlaserve.serving.http.tools import render_messages
from xlaserve.serving.router import ModelGroup, RoutingError
from xlaserve.serving.structured.grammar import GrammarError
from xlaserve.serving.types import (ContextLengthExceeded, SamplingParams, Usage,
                                    checked_max_tokens)

ROUTED_HEADER = "x-xlaserve-routed-model"


async def generate(state: ServingState, kind: str, request: Request, trace: TraceContext,
                   headers: dict[str, str], span: Span = INVALID_SPAN) -> Response:
    """One `kind` ("chat" | "completion") request, stage by stage, each a child span of the
    request's `span` (telemetry.py); `headers` collects what the response adds
    (x-ratelimit-*, the model "auto" routed to)."""
    tel = state.telemetry
    with Intake(state, trace, request.path, span=span) as intake:
        with tel.stage(span, "gateway"):
            refuse_if_draining(state)
            principal = intake.principal = authenticate(state,
                                                        request.headers.get("Authorization"))
            headers.update(check_rate(state, principal))
            body = decode_body(await read_body(state, request))
            intake.model = body.get("model") if isinstance(body.get("model"), str) else None
            parsed = parse(kind, body, state.config.max_n)
        with tel.stage(span, "router") as s:
            group, prompts = route(state, parsed, principal)
            intake.model = group.id
            sampling = sampling_params(parsed, group, prompts)
            await check_constraint(parsed, group)
            s.set_attributes({"xlaserve.model": group.id, "xlaserve.tenant": principal.tenant,
                              "xlaserve.prompt_tokens": sum(len(p) for p in prompts)})
        with tel.stage(span, "admission") as s:
            reservation = intake.reservation = reserve(state, principal, prompts, parsed.n,
                                                       sampling.max_tokens)
            ticket = await admit(state, group, principal, parsed, prompts, sampling.max_tokens)
            s.set_attribute("xlaserve.queue_time_s", ticket.queue_time)
    if parsed.model == "auto":
        headers[ROUTED_HEADER] = group.id
    gen = start_generation(state, Admitted(
        trace=trace, endpoint=request.path, arrived=intake.arrived, principal=principal,
        parsed=parsed, group=group, prompts=prompts, sampling=sampling,
        reservation=reservation, ticket=ticket, span=span))
    return await render(gen)


@dataclass(slots=True)
class Intake:
    """What the stages have learnt of a request that has no Generation yet.  Around them, as a
    context manager: whatever ends the request inside — an ApiError, the client gone (its task
    cancelled while queued in admission, say), a bug — ends it unserved (`fail`), then goes on."""
    state: ServingState
    trace: TraceContext
    endpoint: str
    arrived: float = field(default_factory=time.monotonic)
    principal: Principal | None = None
    model: str | None = None              # as the body names it, then the group it resolved to
    reservation: Reservation | None = None
    span: Span = INVALID_SPAN             # the request's span, ended here if it fails

    def __enter__(self) -> Intake:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(e, ApiError):
            if e.status == 400:
                self.state.metrics.rejections.labels("invalid_request").inc()
            self.fail(e.status, e.code)
        elif e is not None:
            self.fail(*ended_by(e))

    def fail(self, status: int, code: str | None) -> None:
        """End it unserved: its reservation settled to nothing, one audit line."""
        st = self.state
        if self.reservation is not None:
            st.limiter.settle(self.reservation, 0)
        st.telemetry.end(self.span, error=code or f"HTTP {status}", attributes={
            "http.response.status_code": status})
        if st.audit is not None:
            st.audit.write({**audit_record(
                self.trace, self.principal, self.model, self.endpoint, status, Usage(0, 0),
                time.monotonic() - self.arrived), "error": code})


def refuse_if_draining(state: ServingState) -> None:
    if state.draining:
        raise shutting_down("server shutting down")


def authenticate(state: ServingState, authorization: str | None) -> Principal:
    """The `Authorization` header's bearer token -> its tenant, tier and models."""
    try:
        return state.auth.authenticate(authorization)
    except AuthError as e:
        state.metrics.rejections.labels("auth").inc()
        raise ApiError(401, str(e), None, "invalid_api_key",
                       {"WWW-Authenticate": 'Bearer realm="xlaserve"'}) from None


def check_rate(state: ServingState, principal: Principal) -> dict[str, str]:
    """One request from the tenant's request bucket, taken before the body is read (malformed
    floods count too); returns the x-ratelimit-* headers to send."""
    try:
        return state.limiter.check(principal.tenant, principal.tier)
    except RateLimited as e:
        raise rate_limited(state, e) from None


def rate_limited(state: ServingState, e: RateLimited) -> ApiError:
    state.metrics.rejections.labels(e.code).inc()
    return ApiError(429, str(e), None, e.code, {
        **e.headers, "Retry-After": str(max(1, math.ceil(e.retry_after)))})


async def read_body(state: ServingState, request: Request) -> bytes:
    """The raw body, at most `server.max_body_bytes` (413 past that)."""
    try:
        raw = await request.get_data(cache=False, as_text=False)
    except HTTPException as e:
        raise ApiError.from_http(e, state.config.max_body_bytes) from None
    return raw if isinstance(raw, bytes) else raw.encode()


def route(state: ServingState, parsed: ParsedRequest, principal: Principal
          ) -> tuple[ModelGroup, list[list[int]]]:
    """The model group to run on and the prompts' token ids for its tokenizer; "auto" moves to
    the group `Router.choose_auto` picks for the prompt's length if the token may use it."""
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
    """Token ids per prompt: the chat template's, or each completion prompt's (ids checked)."""
    tok = group.tokenizer
    if parsed.kind == "chat":
        try:
            messages, tools = render_messages(parsed.messages, parsed.tools,
                                              tok.template_takes_tools)
            return [tok.encode_chat(messages, tools, parsed.chat_template_kwargs)]
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 (any template error, raise_exception too)
            raise ApiError(400, f"could not apply the chat template: {e}", "messages",
                           "invalid_value") from None
    out = []
    vocab = tok.vocab_size
    for p in parsed.prompts:
        if isinstance(p, str):
            ids = tok.encode(p)
            if not ids:
                raise ApiError(400, "'prompt' encodes to no tokens", "prompt", "invalid_value")
        else:
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"'prompt' has token ids outside [0, {vocab}): {bad[:5]}",
                               "prompt", "invalid_value")
            ids = p
        out.append(ids)
    return out


def sampling_params(parsed: ParsedRequest, group: ModelGroup, prompts: list[list[int]]
                    ) -> SamplingParams:
    """Its SamplingParams, max_tokens checked against (unset: filling, 16 at most for a
    completion) the room the longest prompt leaves in the model's context."""
    try:
        max_tokens = checked_max_tokens(max(len(p) for p in prompts), parsed.max_tokens,
                                        group.max_model_len,
                                        unset=None if parsed.kind == "chat" else 16,
                                        name=parsed.max_tokens_param)
    except ContextLengthExceeded as e:
        param = e.field if e.field != "prompt" else (
            "messages" if parsed.kind == "chat" else "prompt")
        raise ApiError(400, str(e), param, "context_length_exceeded") from None
    # the stop ids the tokenizer knows (generation_config.json's, a GGUF's eot / eom) on top of
    # the engine's own (config.json's eos_token_id), unless the client asked to ignore EOS
    stops = () if parsed.sampling.get("ignore_eos") else group.tokenizer.eos_ids
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=parsed.logprobs,
                              constraint=parsed.constraint, stop_token_ids=tuple(stops),
                              **parsed.sampling)
    except ValueError as e:
        param = str(e).split("=", 1)[0] if "=" in str(e) else None
        raise ApiError(400, str(e), param, "invalid_value") from None


async def check_constraint(parsed: ParsedRequest, group: ModelGroup) -> None:
    """A constraint that does not compile for the group's tokenizer (bad schema, regex or
    grammar, or over the grammar engine's bounds) is a 400 naming its field, before anything
    is queued (engines compile it again, per choice: typically under a millisecond).  The
    compile runs on a worker thread (llguidance releases the GIL), not on the event loop."""
    if parsed.constraint is None:
        return
    try:
        await asyncio.to_thread(group.grammars.start, parsed.constraint)
    except GrammarError as e:
        raise ApiError(400, f"Invalid value for '{parsed.constraint_param}': {e}",
                       parsed.constraint_param, "invalid_grammar") from None


def reserve(state: ServingState, principal: Principal, prompts: list[list[int]], n: int,
            max_tokens: int) -> Reservation:
    """Hold the most it can use (prompts + n x max_tokens each) from the tenant's token limits,
    so that requests in flight together cannot overshoot them (gateway/ratelimit.py)."""
    tokens = sum(len(p) for p in prompts) + len(prompts) * n * max_tokens
    try:
        return state.limiter.reserve(principal.tenant, principal.tier, tokens)
    except RateLimited as e:
        raise rate_limited(state, e) from None


async def admit(state: ServingState, group: ModelGroup, principal: Principal,
                parsed: ParsedRequest, prompts: list[list[int]], max_tokens: int) -> Ticket:
    """Wait for len(prompts) x n lanes of the group's admission controller, each engine request
    costing its mean prompt + max_tokens of work."""
    if not group.ready:
        raise ApiError(503, f"model {group.id!r} is still warming up", None,
                       "model_not_ready", {"Retry-After": "5"})
    try:
        work = Work(sum(len(p) for p in prompts) // len(prompts), max_tokens)
        return await group.admission.acquire(principal.tier, parsed.priority,
                                             len(prompts) * parsed.n, work)
    except Rejected as e:
        state.metrics.rejections.labels(e.reason).inc()
        raise ApiError(429, f"server overloaded: {e}", None, f"overloaded_{e.reason}",
                       {"Retry-After": str(int(e.retry_after))}) from None


def start_generation(state: ServingState, admitted: Admitted) -> Generation:
    """Its Generation (or, failing that, the admission lanes and reservation back, and an
    audit line).  Safety net: a client gone before a streamed body starts never runs the
    body's `finally`, so when this request's task ends, whatever is still open is closed (as
    a 499)."""
    try:
        gen = Generation(state, admitted)
    except BaseException as e:
        admitted.group.admission.release(admitted.ticket)
        Intake(state, admitted.trace, admitted.endpoint, admitted.arrived, admitted.principal,
               admitted.group.id, admitted.reservation, admitted.span).fail(*ended_by(e))
        raise
    task = asyncio.current_task()
    if task is not None:
        task.add_done_callback(lambda _: close_orphan(state, gen))
    return gen


def close_orphan(state: ServingState, gen: Generation) -> None:
    if not gen.closed:
        gen.status = 499
        state.spawn(gen.close())
