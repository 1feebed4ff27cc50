"""The asyncio face of the engine: the device loop runs on its own thread, never on the event
loop's.

    event loop                         engine thread
    submit(req) ─ inbox(add) ────────> LLMEngine.add; step(); step(); ...
       async for event in queue <───── call_soon_threadsafe(queue.put_nowait, event)
    abort(id)   ─ inbox(abort) ──────> LLMEngine.abort (frees blocks at the next turn)

The LLMEngine is touched only by the engine thread.  A consumer that stops iterating (client
gone, cancelled task) aborts its request.  An exception in a device step fails the requests that
were in flight and the loop keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.engine.engine import LLMEngine
from xlaserve.serving.engine_api import EngineStats
from xlaserve.serving.types import EngineEvent, GenerationRequest

log = logging.getLogger(__name__)


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineEvent]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str = "default"):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.ready = False
        self._inbox: deque[tuple[str, Any]] = deque()
        self._waiters: dict[str, _Waiter] = {}
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._completed: deque[float] = deque(maxlen=256)   # finish times, for service rate
        self.last_error: str | None = None
        self._stats = self._snapshot()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Called by the serving event loop: start the engine thread (warm-up runs there;
        `ready` turns True when every bucket is compiled)."""
        if self._thread is None:
            self.launch()

    async def stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def launch(self, warmup: bool = True) -> None:
        """Start the engine thread; compiles every bucket first unless `warmup` is False."""
        def run() -> None:
            if warmup:
                self.engine.runner.warmup()
            self.ready = True
            self._loop()

        self._thread = threading.Thread(target=run, name="xlaserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the async API -------------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        """Stream the request's events; the last one has `finish_reason` set."""
        waiter = _Waiter(asyncio.get_running_loop(), asyncio.Queue())
        rid = request.request_id
        if rid in self._waiters:
            raise ValueError(f"request_id {rid!r} is already in use")
        self._waiters[rid] = waiter
        self._post("add", request)
        finished = False
        try:
            while True:
                event = await waiter.queue.get()
                if event.finished:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self._post("abort", rid)

    async def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def stats(self) -> EngineStats:
        """The snapshot the engine thread took after its latest step (no cross-thread reads
        of the scheduler)."""
        return self._stats

    def _snapshot(self) -> EngineStats:
        s = self.engine.scheduler.stats()
        kv = s.kv_cache
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting,
            kv_blocks_total=kv.num_total_blocks, kv_blocks_used=kv.num_used_blocks,
            kv_blocks_cached=kv.num_cached_free_blocks,
            prefix_cache_queries=s.prefix_cache.queried_tokens,
            prefix_cache_hits=s.prefix_cache.hit_tokens,
            num_preemptions=s.num_preemptions, num_finished=s.num_finished)

    def service_rate(self) -> float:
        """Completed requests per second over the recent window (0 when unknown)."""
        times = list(self._completed)
        if len(times) < 2:
            return 0.0
        span = max(time.monotonic() - times[0], 1e-3)
        return len(times) / span

    # -- the engine thread ---------------------------------------------------------------------

    def _post(self, kind: str, payload: Any) -> None:
        with self._wake:
            self._inbox.append((kind, payload))
            self._wake.notify()

    def _deliver(self, event: EngineEvent) -> None:
        waiter = self._waiters.get(event.request_id)
        if event.finished:
            self._waiters.pop(event.request_id, None)
            self._completed.append(time.monotonic())
        if waiter is not None:
            waiter.loop.call_soon_threadsafe(waiter.queue.put_nowait, event)

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                try:
                    self.engine.add(payload)
                except ValueError as e:
                    self._deliver(EngineEvent(payload.request_id, finish_reason="error",
                                              error=str(e)))
            else:
                self.engine.abort(payload)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._inbox and not self.engine.has_work():
                    self._wake.wait()
                if self._stop:
                    return
            self._drain_inbox()
            try:
                events = self.engine.step()
            except Exception as e:  # a failed device step: fail its requests, keep serving
                log.exception("engine step failed")
                self.last_error = f"{type(e).__name__}: {e}"
                events = self.engine.fail_in_flight(self.last_error)
            self._stats = self._snapshot()
            for event in events:
                self._deliver(event)


def build(served: Any) -> list[AsyncEngine]:
    """The server's engine factory (`engine = "xlaserve.serving.engine.async_engine:build"`):
    load the model folder `served.path` and wrap continuous-batching engines configured by
    `served.engine_args` (EngineConfig fields; `mesh` is a table {pipeline, tensor, replicas}
    or the path of a preset such as configs/tp2.toml).  One engine per mesh replica; each
    compiles its buckets on its own thread once started."""
    from xlaserve.serving.engine.replicas import build_engines
    from xlaserve.sharding.mesh import MeshConfig

    args = dict(served.engine_args)
    mesh = args.pop("mesh", None)
    if isinstance(mesh, str):
        mesh = MeshConfig.load(mesh)
    elif isinstance(mesh, dict):
        mesh = MeshConfig.from_dict(mesh)
    if mesh is not None:
        args["mesh"] = mesh
    engines = build_engines(served.path, EngineConfig(**args), warmup=False)
    return [AsyncEngine(e, model_name=served.name) for e in engines]
