"""`RemoteEngine`: the AsyncEngine protocol over gRPC, so the router can use replicas that run
in other processes or machines (`xlaserve worker`).

The tokenizer stays local (the front end tokenizes and renders chat templates itself); stats,
step costs and readiness are polled every `poll_interval` seconds and served from that cache
(stats() must be cheap); a call failing with UNAVAILABLE marks the replica not ready at once,
so the router stops picking it before the next poll.  Closing a stream early cancels the call,
which makes the worker abort the request; abort() also sends an explicit Abort.  The channel is
opened in the event loop that serves (`start()`), since grpc.aio channels belong to one loop:
a secure one with `credentials` (TLS, a client certificate, the bearer token: see auth.py's
`channel_credentials`), a plain one without.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from xlaserve.serving.engine_api import EngineStats, ServiceCosts
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.grpc.convert import (
    costs_from_pb,
    event_from_pb,
    request_to_pb,
    stats_from_pb,
)
from xlaserve.serving.telemetry import Telemetry
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import EngineEvent, GenerationRequest, KVHandoff


class RemoteEngine:
    def __init__(self, target: str, model_name: str, tokenizer: Tokenizer, *,
                 credentials: grpc.ChannelCredentials | None = None,
                 poll_interval: float = 0.5, connect_timeout: float = 30.0):
        self.target = target
        self.credentials = credentials
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = 0
        self.poll_interval = poll_interval
        self.connect_timeout = connect_timeout
        self._ready = False
        self._stats = EngineStats()
        self._costs = ServiceCosts()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GenerationStub | None = None
        self._poller: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return self._ready

    async def start(self) -> None:
        """Open the channel, learn max_model_len, start polling stats."""
        if self._channel is not None:
            return
        self._channel = (grpc.aio.secure_channel(self.target, self.credentials)
                         if self.credentials is not None
                         else grpc.aio.insecure_channel(self.target))
        self._stub = pb_grpc.GenerationStub(self._channel)
        # wait_for_ready: a worker still starting up is waited for (up to connect_timeout)
        # instead of failing the server's start on the first refused connection.
        models = await self._stub.ListModels(pb.ListModelsRequest(),
                                             timeout=self.connect_timeout, wait_for_ready=True)
        info = [m for m in models.models if m.name == self.model_name]
        if not info:
            raise ValueError(f"{self.target} does not serve {self.model_name!r}; it serves "
                             f"{[m.name for m in models.models]}")
        self.max_model_len = info[0].max_model_len
        await self._poll_once()
        self._poller = asyncio.ensure_future(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = self._poller = None
        self._ready = False

    async def _poll_once(self) -> None:
        assert self._stub is not None
        try:
            s = await self._stub.GetStats(pb.GetStatsRequest(model=self.model_name),
                                          timeout=max(1.0, self.poll_interval * 4))
            self._stats, self._costs, self._ready = stats_from_pb(s), costs_from_pb(s), s.ready
        except grpc.aio.AioRpcError:
            self._ready = False

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            await self._poll_once()

    def stats(self) -> EngineStats:
        return self._stats

    def service_costs(self) -> ServiceCosts:
        return self._costs

    async def submit(self, request: GenerationRequest, *, kv_source: str = ""
                     ) -> AsyncIterator[EngineEvent]:
        """`kv_source` ("host:port"): the worker holding the prompt's KV, fetched by this
        worker before the request is queued (serving/disagg/)."""
        if self._stub is None:
            await self.start()
        assert self._stub is not None
        message = request_to_pb(request, self.model_name)
        message.kv_source = kv_source
        # the caller's current span (the front end's engine span) rides along: the worker's
        # span joins the request's trace (telemetry.py)
        call = self._stub.Generate(message, metadata=Telemetry.inject())
        finished = False
        try:
            async for m in call:
                ev = event_from_pb(m)
                yield ev
                if ev.finished:
                    finished = True
                    return
            finished = True
            yield EngineEvent(request.request_id, finish_reason="error",
                              error=f"{self.target}: stream ended without a finish event")
        except grpc.aio.AioRpcError as e:
            finished = True
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # The worker is gone or unreachable: stop routing to it now rather than at the
                # next poll (which marks it ready again once it answers).
                self._ready = False
            yield EngineEvent(request.request_id, finish_reason="error",
                              error=f"{self.target}: {e.code().name}: {e.details()}")
        finally:
            if not finished:
                call.cancel()

    async def prefetch(self, request: GenerationRequest, source: str, timeout: float
                       ) -> tuple[KVHandoff, bool]:
        """This (decode) worker's PrefetchKV: the prompt's KV taken from `source` while the
        request's prefill runs there; what moved and whether every full block of the prompt
        is held here now ((nothing, False) when the call failed: the Generate fetches)."""
        if self._stub is None:
            await self.start()
        assert self._stub is not None
        try:
            r = await self._stub.PrefetchKV(pb.PrefetchKVRequest(
                model=self.model_name, prompt_token_ids=list(request.prompt_token_ids),
                tenant=request.tenant, kv_source=source, request_id=request.request_id),
                timeout=timeout)
        except grpc.aio.AioRpcError:
            return KVHandoff(0, 0, 0.0), False
        return KVHandoff(r.kv_blocks, r.kv_bytes, r.kv_seconds), r.complete

    async def abort(self, request_id: str) -> None:
        if self._stub is None:
            return
        try:
            await self._stub.Abort(pb.AbortRequest(request_id=request_id,
                                                   model=self.model_name), timeout=5)
        except grpc.aio.AioRpcError:
            pass  # the worker is gone: nothing left to free there
