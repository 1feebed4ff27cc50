"""The gRPC front end: `Generation` (Generate / Abort / ListModels / GetStats) over one or more
engines, plus the standard grpc.health.v1 service (SERVING once every engine is ready) and
server reflection (grpc.reflection.v1alpha: `grpcurl -plaintext HOST:PORT list` lists the
three; health and reflection need no token, see auth.py).

Generate streams the engine's events; if the client cancels the call or its deadline passes,
grpc cancels the handler and the `finally` aborts the engine request, freeing its blocks.  A
split request's decode part first fetches its prompt's KV (`kv_source`): a cancellation or an
Abort of its id during that fetch ends it there (an "abort" event), before the engine sees it.  A
request id stays reserved (another Generate with it gets ALREADY_EXISTS) until its request's
abort is in the engine's hands; the engine then holds a request reusing the id until it has
let go of the old one.

`serving/grpc/worker.py` runs a local engine behind this server (`xlaserve worker`), the
replica a front-end router reaches through `RemoteEngine`.  This is the internal, worker-side
protocol:
it has no gateway (no JWT, no rate limits, tenant and tier are the caller's word), so public
traffic goes through the HTTP front end and the worker admits only the front end: TLS, client
certificates and a bearer token (`WorkerAuth`, drawn in auth.py).  Without credentials it
binds loopback only; the flags are checked before the engine is built.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from xlaserve.serving.disagg.transfer import (
    PrefixFetcher,
    adopt_prefix,
    follow_export,
    prefetch_prefix,
    to_messages,
)
from xlaserve.serving.engine_api import AsyncEngine
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.grpc.auth import WorkerAuth
from xlaserve.serving.grpc.convert import (
    event_to_pb,
    sampling_from_pb,
    speculative_from_pb,
    stats_to_pb,
    tier_from_pb,
)
from xlaserve.serving.metrics import StreamTimes
from xlaserve.serving.server_config import target_host
from xlaserve.serving.telemetry import Telemetry
from xlaserve.serving.types import (ContextLengthExceeded, EngineEvent, GenerationRequest,
                                    KVHandoff, Usage, checked_max_tokens)

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name   # "xlaserve.v1.Generation"
SERVICES = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME)   # what reflection lists


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engines: Mapping[str, AsyncEngine], telemetry: Telemetry | None = None,
                 fetcher: PrefixFetcher | None = None, role: str = "both"):
        """`fetcher` dials the workers a request's kv_source names (default: plain loopback
        channels); `role` (prefill | decode | both) the parts of split requests it takes: a
        prefill worker refuses decode parts (kv_source set), a decode worker prefill parts
        (continues set), so that a misconfigured router fails loudly."""
        if role not in ROLES:
            raise ValueError(f"role={role!r}: choose from {ROLES}")
        self.role = role
        if not engines:
            raise ValueError("GenerationServicer needs at least one engine")
        self.engines = dict(engines)
        self.inflight: set[str] = set()
        self.ended: collections.deque[str] = collections.deque(maxlen=1024)   # latest ids done
        # split requests whose prompt KV is being fetched: id -> (engine, set by its Abort)
        self.fetching: dict[str, tuple[AsyncEngine, asyncio.Event]] = {}
        self.telemetry = telemetry or Telemetry()
        # (engine, "prefetched" | "fetched") -> KV blocks received for split requests
        self.kv_moved: collections.Counter[tuple[AsyncEngine, str]] = collections.Counter()
        self.fetcher = fetcher or PrefixFetcher(lambda target: None)

    async def _engine(self, name: str, context: grpc.aio.ServicerContext) -> AsyncEngine:
        if not name and len(self.engines) == 1:
            return next(iter(self.engines.values()))
        if name not in self.engines:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {name!r} not served here; models: {sorted(self.engines)}")
        return self.engines[name]

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        engine = await self._engine(request.model, context)
        bad = grpc.StatusCode.INVALID_ARGUMENT
        ids = list(request.prompt_token_ids) or (
            engine.tokenizer.encode(request.prompt) if request.prompt else [])
        if not ids:
            await context.abort(bad, "prompt_token_ids or prompt is required")
        try:
            sampling = sampling_from_pb(request.sampling)
            tier = tier_from_pb(request.tier)
        except ValueError as e:
            await context.abort(bad, str(e))
        try:
            checked_max_tokens(len(ids), sampling.max_tokens, engine.max_model_len)
        except ContextLengthExceeded as e:
            await context.abort(bad, str(e))
        if (self.role == "prefill" and request.kv_source) or (
                self.role == "decode" and request.continues):
            await context.abort(bad, f"this is a {self.role} worker: it does not take the "
                                     f"{'decode' if request.kv_source else 'prefill'} part "
                                     "of a split request")
        rid = request.request_id or "grpc-" + secrets.token_hex(8)
        if rid in self.inflight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is running")
        if not engine.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is warming up")
        self.inflight.add(rid)
        finished, final = False, EngineEvent(rid)   # final: its finish event, once seen
        loop = asyncio.get_running_loop()
        times = StreamTimes(time.monotonic())
        span = self.telemetry.server_span("/" + SERVICE + "/Generate",
                                          context.invocation_metadata(), {
                                              "xlaserve.engine_request_id": rid,
                                              "xlaserve.prompt_tokens": len(ids)})
        handoff, stream = None, None
        try:
            if request.kv_source:   # a decode worker's part of a split request: its prompt's KV
                aborted, handoff = await self._fetch_kv(rid, engine, request, ids)
                if aborted:
                    finished = True
                    yield event_to_pb(EngineEvent(rid, finish_reason="abort",
                                                  usage=Usage(len(ids), 0)))
                    return
            stream = engine.submit(GenerationRequest(
                rid, ids, sampling, tier, request.priority, request.tenant, None, loop.time(),
                speculative_from_pb(request), output_token_ids=tuple(request.output_token_ids),
                continues=request.continues))
            async for ev in stream:
                times.saw(len(ev.token_ids), time.monotonic())
                if handoff is not None:
                    ev, handoff = dataclasses.replace(ev, kv_handoff=handoff), None
                yield event_to_pb(ev)
                if ev.finished:
                    finished, final = True, ev
                    break
        finally:
            self.telemetry.end_stream(span, times, None, final.error if finished else "cancelled",
                                      final.finish_reason or "cancelled")
            # a task of its own: a second cancellation of this handler cannot leave the id
            # reserved for good
            end = asyncio.ensure_future(self._end(engine, rid, stream, finished))
            with contextlib.suppress(BaseException):  # the original exception goes on
                await asyncio.shield(end)

    async def _fetch_kv(self, rid: str, engine: AsyncEngine, request: pb.GenerateRequest,
                        ids: list[int]) -> tuple[bool, KVHandoff | None]:
        """(aborted, handoff): adopt_prefix from the request's kv_source, unless an Abort of
        `rid` comes first (True: the fetch is cancelled, the request never reaches the engine).
        The call's own cancellation (the front end gone) cancels the fetch too.  Either way
        nothing is held: adopted blocks are cached free (engine/kv_handoff.py)."""
        abort = asyncio.Event()
        self.fetching[rid] = (engine, abort)
        fetch = asyncio.ensure_future(adopt_prefix(self.fetcher, engine, request.kv_source,
                                                   request.model, ids, request.tenant))
        aborted = asyncio.ensure_future(abort.wait())
        try:
            done, _ = await asyncio.wait({fetch, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            del self.fetching[rid]
            aborted.cancel()
            if not fetch.done():
                fetch.cancel()
        if fetch not in done:
            return True, None
        handoff = fetch.result()
        self.kv_moved[engine, "fetched"] += handoff.blocks if handoff is not None else 0
        return False, handoff

    async def _end(self, engine: AsyncEngine, rid: str,
                   stream: AsyncIterator[EngineEvent] | None, finished: bool) -> None:
        """Abort the request unless it finished (cancelled, deadline, or the engine stream
        broke), close its stream, and only then free its id: a request reusing the id earlier
        could be hit by this one's abort."""
        try:
            if stream is None:   # it never reached the engine (gone during its KV fetch)
                return
            if not finished:
                with contextlib.suppress(Exception):
                    await engine.abort(rid)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self.inflight.discard(rid)
            self.ended.append(rid)

    async def ExportKV(self, request: pb.ExportKVRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KVBlocks]:
        engine = await self._engine(request.model, context)
        call = getattr(engine, "call", None)
        if call is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"{type(engine).__name__} cannot export its KV")
        ids, tenant, first = list(request.prompt_token_ids), request.tenant, request.first_block
        if first < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"first_block {first} < 0")
        rid = request.follow_request_id
        # without a request to follow, one export of what is cached (as if it had left)
        running = (lambda: self._running(rid)) if rid else (lambda: False)
        async for kv in follow_export(call, ids, tenant, first, running):
            for message in to_messages(kv):
                yield message

    def _running(self, rid: str) -> bool | None:
        """Is `rid` running here (True), has it ended here lately (False), or neither."""
        return True if rid in self.inflight else (False if rid in self.ended else None)

    async def PrefetchKV(self, request: pb.PrefetchKVRequest,
                         context: grpc.aio.ServicerContext) -> pb.PrefetchKVResponse:
        engine = await self._engine(request.model, context)
        if self.role == "prefill" or not request.kv_source:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"PrefetchKV from kv_source {request.kv_source!r} on a "
                                f"{self.role} worker: it needs a source and a decode worker")
        handoff, complete = await prefetch_prefix(
            self.fetcher, engine, request.kv_source, request.model,
            list(request.prompt_token_ids), request.tenant, request.request_id)
        self.kv_moved[engine, "prefetched"] += handoff.blocks
        return pb.PrefetchKVResponse(kv_blocks=handoff.blocks, kv_bytes=handoff.nbytes,
                                     kv_seconds=handoff.seconds, complete=complete)

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        engines = [await self._engine(request.model, context)] if request.model else \
            list(self.engines.values())
        fetching = self.fetching.get(request.request_id)
        if fetching is not None and fetching[0] in engines:
            fetching[1].set()   # not in the engine yet: its Generate ends the fetch
        for e in engines:
            await e.abort(request.request_id)
        return pb.AbortResponse()

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[
            pb.ModelInfo(name=n, max_model_len=e.max_model_len, ready=e.ready)
            for n, e in self.engines.items()])

    async def GetStats(self, request: pb.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> pb.EngineStats:
        e = await self._engine(request.model, context)
        out = stats_to_pb(e.stats(), e.service_costs(), e.ready)
        out.kv_fetching = sum(1 for engine, _ in self.fetching.values() if engine is e)
        out.kv_blocks_prefetched = self.kv_moved[e, "prefetched"]
        out.kv_blocks_fetched = self.kv_moved[e, "fetched"]
        return out


async def _watch_health(health: HealthServicer, engines: Mapping[str, AsyncEngine]) -> None:
    last = None
    while True:
        ok = all(e.ready for e in engines.values())
        if ok != last:
            status = (health_pb2.HealthCheckResponse.SERVING if ok
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for svc in ("", SERVICE):
                await health.set(svc, status)
            last = ok
        await asyncio.sleep(0.25)


async def start_grpc_server(engines: Mapping[str, AsyncEngine], address: str,
                            auth: WorkerAuth = WorkerAuth(), telemetry: Telemetry | None = None,
                            fetcher: PrefixFetcher | None = None, role: str = "both"
                            ) -> tuple[grpc.aio.Server, int, asyncio.Task[None]]:
    """Start serving on `address` ("host:port", port 0 = any) with `auth`'s credentials (the
    default: none, loopback only), spans to `telemetry` (default: none); returns (server,
    port, health watcher task).  Call `server.stop(grace)` and cancel the task to shut
    down."""
    auth.check_bind(target_host(address))
    server = grpc.aio.server(interceptors=auth.interceptors())
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engines, telemetry, fetcher, role), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(SERVICES, server)
    port = auth.add_port(server, address)
    if port == 0:
        raise ValueError(f"gRPC: could not bind {address!r}")
    await server.start()
    watcher = asyncio.ensure_future(_watch_health(health, engines))
    return server, port, watcher
