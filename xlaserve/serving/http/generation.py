"""`Generation`, one client request's fan-out into engine requests with the bookkeeping that
must happen however it ends; `Admitted`, the request as the pipeline hands it over.

    Generation(state, admitted) -> one engine request per prompt x n ("choice"), each on a
                                   replica picked for its prompt
    Generation.events()         -> submit them, yield (Choice, EngineEvent) as they come, each
                                   stream ending once; a choice whose replica goes down before
                                   its first token is resubmitted to a live one
    Generation.close()          -> abort unfinished engine requests, release the admission
                                   lanes, settle the tenant's token reservation to what was
                                   served, observe metrics, write the audit line  (exactly once)
    Generation.stop(reason)     -> (ServingState.drain) abort the unfinished choices; the
                                   response in progress reports `reason` (a 503)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace import INVALID_SPAN, Span

from xlaserve.serving.admission import Ticket
from xlaserve.serving.gateway.auth import Principal
from xlaserve.serving.gateway.ratelimit import Reservation
from xlaserve.serving.gateway.tracing import TraceContext
from xlaserve.serving.http.protocol import ParsedRequest
from xlaserve.serving.http.state import ServingState
from xlaserve.serving.metrics import StreamTimes
from xlaserve.serving.router import ModelGroup, Replica
from xlaserve.serving.types import EngineEvent, GenerationRequest, SamplingParams, Usage


@dataclass(frozen=True, slots=True)
class Admitted:
    """A generation request that passed every stage up to admission (`http/pipeline.py`), as
    its Generation takes it; `Generation.close()` gives back its admission lanes and reservation."""
    trace: TraceContext
    endpoint: str                 # the request's path, for the audit line
    arrived: float                # time.monotonic() when it came in
    principal: Principal
    parsed: ParsedRequest
    group: ModelGroup             # the model it runs on ("auto" resolved)
    prompts: list[list[int]]      # token ids, one list per prompt
    sampling: SamplingParams      # max_tokens resolved against the context length
    reservation: Reservation      # prompt + n x max_tokens tokens held from the tenant's limits
    ticket: Ticket                # its len(prompts) x n admission lanes
    span: Span = INVALID_SPAN     # its request span (telemetry.py), ended by Generation.close


@dataclass
class Choice:
    index: int
    prompt_index: int
    request: GenerationRequest
    replica: Replica
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    times: StreamTimes = field(default_factory=StreamTimes)   # submitted: to its last engine
    span: Span | None = None    # its engine span, from its first submit


class Generation:
    """One admitted request's n x len(prompts) engine requests ("choices"), each on a replica
    picked by its prompt; `close()` does what must happen however the request ends."""

    def __init__(self, state: ServingState, admitted: Admitted):
        self.state = state
        self.admitted = admitted
        self.status = 200
        self.closed = False
        self.stopped: str | None = None   # why the server stopped it (shutdown), if it did
        self.choices: list[Choice] = []
        a, n = admitted, admitted.parsed.n
        fan = len(a.prompts) * n
        for p, ids in enumerate(a.prompts):
            for j in range(n):
                i = p * n + j
                s = a.sampling
                if n > 1 and s.seed is not None:  # distinct but reproducible choices
                    s = SamplingParams(**{**s.__dict__, "seed": s.seed + j})
                rid = state.new_engine_id(a.trace.request_id if fan == 1
                                          else f"{a.trace.request_id}-{i}")
                req = GenerationRequest(rid, list(ids), s, a.principal.tier, a.parsed.priority,
                                        a.principal.tenant, None, a.arrived,
                                        a.parsed.speculative)
                replica = self.group.pick(ids, a.principal.tenant)
                replica.inflight += 1
                replica.routed += 1
                self.choices.append(Choice(i, p, req, replica))
        self._queue: asyncio.Queue[tuple[int, EngineEvent]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        state.generations.add(self)

    async def stop(self, reason: str) -> None:
        """Abort the unfinished choices through their engines; the response in progress sees
        their "abort" ends and reports `reason` (settled as a 503)."""
        self.stopped = reason
        await asyncio.gather(*(c.replica.engine.abort(c.request.request_id)
                               for c in self.choices if c.finish_reason is None),
                             return_exceptions=True)

    @property
    def group(self) -> ModelGroup:
        return self.admitted.group

    async def _pump(self, c: Choice) -> None:
        try:
            moves = len(self.group.replicas) - 1
            while True:
                sent = False
                c.times.submitted = time.monotonic()
                self._engine_span(c)
                events = c.replica.engine.submit(c.request)
                try:
                    async for ev in events:
                        if (ev.finish_reason == "error" and not sent and moves > 0
                                and self._fail_over(c)):
                            moves -= 1
                            assert c.span is not None
                            c.span.add_event("failover", {"error": ev.error or ""})
                            break  # nothing reached the client yet: run it elsewhere
                        sent = sent or bool(ev.token_ids or ev.text)
                        await self._queue.put((c.index, ev))
                        if ev.finished:
                            return
                    else:
                        await self._queue.put((c.index, EngineEvent(
                            c.request.request_id, finish_reason="error",
                            error="engine stream ended without a finish event")))
                        return
                finally:
                    aclose = getattr(events, "aclose", None)
                    if aclose is not None:
                        await aclose()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 (an engine failure fails this choice, not the server)
            await self._queue.put((c.index, EngineEvent(
                c.request.request_id, finish_reason="error", error=f"{type(e).__name__}: {e}")))

    def _engine_span(self, c: Choice) -> None:
        """Start `c`'s engine span (on its first submit) and make it current in this task,
        so that a gRPC replica's call carries it to the worker."""
        if c.span is None:
            c.span = self.state.telemetry.child(self.admitted.span, "engine", c.times.submitted, {
                "xlaserve.engine_request_id": c.request.request_id,
                "xlaserve.prompt_tokens": len(c.request.prompt_token_ids),
                "gen_ai.request.max_tokens": c.request.sampling.max_tokens})
        c.span.set_attribute("xlaserve.replica", c.replica.name)
        context.attach(trace.set_span_in_context(c.span))   # this task's context only

    def _end_spans(self, usage: Usage) -> None:
        tel, end = self.state.telemetry, time.monotonic()
        for c in self.choices:
            if c.span is None:
                continue
            tel.end_stream(c.span, c.times, end, c.error, c.finish_reason or "abort")
        tel.end(self.admitted.span, end, f"HTTP {self.status}" if self.status >= 500 else None,
                {"http.response.status_code": self.status,
                 "gen_ai.usage.input_tokens": usage.prompt_tokens,
                 "gen_ai.usage.output_tokens": usage.completion_tokens})

    def _fail_over(self, c: Choice) -> bool:
        """`c`'s replica failed it before any token and is now marked down (a remote worker
        that died or cannot be reached): move `c` to a live replica.  False when the replica
        still counts as up (the engine failed this request: that is the answer) or no other
        replica is up."""
        old = c.replica
        if old.engine.ready:
            return False
        new = self.group.pick(c.request.prompt_token_ids, self.admitted.principal.tenant)
        if new is old or not new.engine.ready:
            return False
        old.inflight -= 1
        new.inflight += 1
        new.routed += 1
        c.replica = new
        return True

    async def events(self) -> AsyncIterator[tuple[Choice, EngineEvent]]:
        """Merged events of all choices; ends when every choice has finished."""
        self._tasks = [asyncio.ensure_future(self._pump(c)) for c in self.choices]
        pending = len(self.choices)
        m = self.state.metrics.itl.labels(self.group.id)
        while pending:
            i, ev = await self._queue.get()
            c = self.choices[i]
            t, now = c.times, time.monotonic()
            if ev.token_ids:
                if t.first:
                    m.observe(now - t.last)
                else:
                    self.state.metrics.ttft.labels(self.group.id).observe(
                        now - self.admitted.arrived)
                t.saw(len(ev.token_ids), now)
                c.token_ids.extend(ev.token_ids)
            c.text += ev.text
            if ev.kv_handoff is not None:   # a split request's decode part began
                self.state.metrics.kv_transfer_seconds.labels(self.group.id).observe(
                    ev.kv_handoff.seconds)
                self.state.metrics.kv_transfer_bytes.labels(self.group.id).inc(
                    ev.kv_handoff.nbytes)
            if ev.finished:
                c.finish_reason, c.usage, c.error = ev.finish_reason, ev.usage, ev.error
                pending -= 1
            yield c, ev

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.admitted.prompts)
        completion = sum(c.usage.completion_tokens if c.usage else len(c.token_ids)
                         for c in self.choices)
        # per prompt, the cached tokens of its first choice that reported usage
        cached = {c.prompt_index: c.usage.cached_tokens for c in reversed(self.choices)
                  if c.usage}
        return Usage(prompt, completion, sum(cached.values()))

    def _ttft(self) -> float | None:
        """Seconds from arrival to the first token of the earliest choice (None: no token)."""
        firsts = [c.times.first for c in self.choices if c.times.first]
        return round(min(firsts) - self.admitted.arrived, 4) if firsts else None

    def served_tokens(self) -> int:
        """What the tenant is charged: nothing when the server failed the request (5xx);
        otherwise the completion tokens produced plus each prompt the engine ran (one of its
        choices produced a token or finished)."""
        if self.status >= 500:
            return 0
        ran = {c.prompt_index for c in self.choices
               if c.token_ids or c.finish_reason in ("stop", "length")}
        return sum(len(self.admitted.prompts[p]) for p in ran) + self.usage().completion_tokens

    async def close(self) -> None:
        """Idempotent; safe to call from a cancelled task (the work runs in its own task)."""
        if self.closed:
            return
        self.closed = True
        await asyncio.shield(self.state.spawn(self._close()))

    async def _close(self) -> None:
        st, a, grp = self.state, self.admitted, self.group
        for t in self._tasks:
            t.cancel()
        unfinished = [c for c in self.choices if c.finish_reason is None]
        for c in unfinished:
            c.finish_reason = "abort"
        await asyncio.gather(*(c.replica.engine.abort(c.request.request_id) for c in unfinished),
                             return_exceptions=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in self.choices:
            c.replica.inflight -= 1
            st.engine_ids.discard(c.request.request_id)
            if c.finish_reason in ("stop", "length"):   # its cache holds prompt + output
                grp.remember(c.replica, [*c.request.prompt_token_ids, *c.token_ids],
                             a.principal.tenant)
            st.metrics.requests.labels(grp.id, c.finish_reason or "abort").inc()
            st.metrics.observe_choice(grp.id, c.times)
        grp.admission.release(a.ticket)
        st.update_admission_gauges()
        st.generations.discard(self)
        u = self.usage()
        self._end_spans(u)
        latency = time.monotonic() - a.arrived
        st.metrics.e2e.labels(grp.id).observe(latency)
        st.metrics.queue_time.labels(grp.id).observe(a.ticket.queue_time)
        st.metrics.prompt_tokens.labels(grp.id, a.principal.tenant).inc(u.prompt_tokens)
        st.metrics.generation_tokens.labels(grp.id, a.principal.tenant).inc(u.completion_tokens)
        st.metrics.observe_request(grp.id, u.prompt_tokens, u.completion_tokens,
                                   a.sampling.max_tokens, a.parsed.n)
        if st.audit is not None:
            st.audit.write({
                **audit_record(a.trace, a.principal, grp.id, a.endpoint, self.status, u, latency),
                "queue_s": round(a.ticket.queue_time, 4), "ttft_s": self._ttft(),
                "finish_reasons": [c.finish_reason for c in self.choices],
                "replicas": [c.replica.name for c in self.choices],
                **({"user": a.parsed.user} if a.parsed.user else {}),
                # kept only if the log keeps prompts (AuditLog.write)
                "prompt": a.parsed.messages if a.parsed.kind == "chat" else a.parsed.prompts})
        st.limiter.settle(a.reservation, self.served_tokens())


def audit_record(trace: TraceContext, principal: Principal | None, model: str | None,
                 endpoint: str, status: int, usage: Usage, latency_s: float) -> dict[str, Any]:
    """The fields every audit line starts with, in this order (gateway/audit.py); `principal`
    and `model` are None on the line of a request that ended before they were known."""
    return {"ts": round(time.time(), 3), "request_id": trace.request_id,
            "trace_id": trace.trace_id, "tenant": principal.tenant if principal else None,
            "tier": principal.tier.name.lower() if principal else None, "model": model,
            "endpoint": endpoint, "status": status, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens, "cached_tokens": usage.cached_tokens,
            "latency_s": round(latency_s, 4)}
