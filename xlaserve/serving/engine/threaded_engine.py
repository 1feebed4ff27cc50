"""The asyncio face of the engine: the device loop runs on its own thread, never on the event
loop's.

    event loop                         engine thread
    submit(req) ─ inbox(add) ────────> LLMEngine.add; step(); step(); ...
       async for event in queue <───── call_soon_threadsafe(queue.put_nowait, event)
    abort(id)   ─ inbox(abort) ──────> LLMEngine.abort (frees blocks at the next turn)

The LLMEngine is touched only by the engine thread.  A request holds its id until the thread has
delivered its final event; a submit reusing the id of an aborted request meanwhile waits for
that (the thread handles the abort at its next turn) rather than being refused, and a submit
reusing a running request's id is refused.  A consumer that stops iterating (client
gone, cancelled task) aborts its request.  An exception in a device step fails the requests that
were in flight and the loop keeps serving the rest.

A mesh that spans processes (multi-host) is driven from process 0 only:

    process 0: ThreadedEngine's thread              process k > 0: ThreadedEngine.follow()
      warmup()            <── collectives ──>       warmup()   (same buckets, same order)
      step(); step(); ... ── runner broadcasts ──>  runner.follow(): the same calls
      shutdown: runner.close() ── STOP ─────────>   follow() returns

There a failed step is fatal: the processes may be out of step (or one is dead), so the engine
ends every request it holds with an error, answers later submits with one, stops its thread and
reports through `wait_failed()` (the server then stops serving).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from xlaserve.serving.engine.engine import LLMEngine
from xlaserve.serving.engine_api import EngineStats, ServiceCosts
from xlaserve.serving.types import EngineEvent, GenerationRequest

log = logging.getLogger(__name__)
T = TypeVar("T")

LAUNCH_LEAD_S = 0.004   # launch the next step this long before the running one should end
POLL_S = 0.001          # how often the wait for the launch window checks the device
# No window behind steps shorter than this: single-stream decode (~15 ms steps on a 2-core
# CPU) lost ~1 ms a token to late launches with it (BENCHMARKS.md, "the launch window").
MIN_WINDOW_STEP_S = 0.025


@dataclass
class _Waiter:
    """A submitted request's consumer: where its events go, and whether it still holds its id."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineEvent]
    aborted: bool = False    # an abort is on its way to the engine thread
    # done once the thread has let go of the request (delivered its final event, or failed it)
    released: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)

    def send(self, event: EngineEvent) -> None:
        """Hand `event` to the consumer's loop (from the engine thread); a final one lets go of
        the request's id."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        if event.finished:
            self.released.set_result(None)


class ThreadedEngine:
    """An LLMEngine on its own thread, behind the AsyncEngine protocol (engine_api.py) that
    the front ends use."""

    def __init__(self, engine: LLMEngine, model_name: str = "default"):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.scheduler.max_model_len
        self.ready = False
        self._inbox: deque[tuple[str, Any]] = deque()
        self._waiters: dict[str, _Waiter] = {}
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        self.fatal_error: str | None = None   # set once it failed for good: no more work
        self._failed: concurrent.futures.Future[str] = concurrent.futures.Future()  # its error
        self._stats = self._snapshot()

    @property
    def kernels(self) -> dict[str, str]:
        """Attention backend, platform and dtype the engine's runner serves with."""
        return self.engine.runner.kernels

    @property
    def spans_processes(self) -> bool:
        """Does this engine's mesh span several processes (driven from process 0)?"""
        return self.engine.runner.channel is not None

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
            try:
                if warmup:
                    self.engine.warmup()
                    self.engine.calibrate()
            except Exception as e:  # the engine can never serve: say so, and why
                self._fail_for_good(e, f"warm-up failed ({type(e).__name__}: {e}); this "
                                       f"engine never became ready")
                return
            try:
                self.ready = True
                self._loop()
            except Exception as e:  # a multi-host reset/close failed
                if not self.spans_processes:
                    raise
                self._fail_for_good(e)

        self._thread = threading.Thread(target=run, name="xlaserve-engine", daemon=True)
        self._thread.start()

    def follow(self) -> int:
        """On a process other than 0 of a multi-host mesh: compile the buckets process 0
        compiles (the step channel's warm-up is a collective), then run every call process 0
        launches until it closes the runner.  Returns the number of calls; raises when process
        0 dies or stops answering."""
        runner = self.engine.runner
        if not self.spans_processes or runner.is_leader:
            raise RuntimeError("follow() is for processes other than 0 of a multi-host mesh")
        runner.warmup()
        self.ready = True
        return runner.follow()

    async def wait_failed(self) -> str:
        """Returns (the error) once the engine failed for good: its warm-up failed, or a step
        on a multi-host mesh did (a single-host step failure is recovered from); never
        otherwise."""
        # shielded: a cancelled wait must not cancel the future other waiters share
        return await asyncio.shield(asyncio.wrap_future(self._failed))

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the async API -------------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        """Stream the request's events; the last one has `finish_reason` set.  Raises
        ValueError when a running request has the same id."""
        waiter = _Waiter(asyncio.get_running_loop(), asyncio.Queue())
        rid = request.request_id
        await self._aborted_released(rid)
        with self._wake:   # atomic with _fail_for_good: a waiter is either failed or refused
            refused = self.fatal_error
            if refused is None:
                if rid in self._waiters:
                    raise ValueError(f"request_id {rid!r} is already in use")
                self._waiters[rid] = waiter
                self._inbox.append(("add", request))
                self._wake.notify()
        if refused is not None:
            yield EngineEvent(rid, finish_reason="error", error=refused)
            return
        finished = False
        try:
            while not finished:
                event = await waiter.queue.get()
                finished = event.finished
                yield event
        finally:
            if not finished:
                self._post_abort(rid)

    async def abort(self, request_id: str) -> None:
        self._post_abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` run on the engine thread between two steps (the LLMEngine is touched
        by that thread only): the KV handoff's export and import (engine/kv_handoff.py)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._wake:
            if self.fatal_error is not None:
                raise RuntimeError(self.fatal_error)
            self._inbox.append(("call", (fn, future)))
            self._wake.notify()
        return await asyncio.wrap_future(future)

    async def _aborted_released(self, rid: str) -> None:
        """Wait while `rid` is held by an aborted request the engine thread has not let go of
        (its abort event would otherwise reach the new request's stream)."""
        while True:
            with self._wake:
                old = self._waiters.get(rid)
            if old is None or not old.aborted:
                return
            # shielded: a cancelled wait must not cancel the future others wait on too
            await asyncio.shield(asyncio.wrap_future(old.released))

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
            num_preemptions=s.num_preemptions, num_finished=s.num_finished,
            spec_num_drafts=s.spec.num_drafts, spec_num_draft_tokens=s.spec.num_draft_tokens,
            spec_num_accepted_tokens=s.spec.num_accepted_tokens,
            spec_acceptance_counts=tuple(s.spec.acceptance_counts))

    def service_costs(self) -> ServiceCosts:
        """The engine thread's latest measure of its step costs (calibrated in warm-up)."""
        return self.engine.costs.costs

    # -- the engine thread ---------------------------------------------------------------------

    def _post_abort(self, rid: str) -> None:
        with self._wake:
            waiter = self._waiters.get(rid)
            if waiter is not None:
                waiter.aborted = True
            self._inbox.append(("abort", rid))
            self._wake.notify()

    def _deliver(self, event: EngineEvent) -> None:
        waiter = self._waiters.get(event.request_id)
        if waiter is None:   # ended already (e.g. by `_recover`): a late abort event
            return
        if event.finished:
            self._waiters.pop(event.request_id, None)
        waiter.send(event)

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                try:
                    self.engine.add(payload)
                except ValueError as e:
                    self._deliver(EngineEvent(payload.request_id, finish_reason="error",
                                              error=str(e)))
            elif kind == "call":
                fn, future = payload
                # a caller cancelled meanwhile (a KV fetch whose request went away) cancelled
                # the future: skip it (setting its result would raise on this thread)
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:  # the caller's to handle
                    future.set_exception(e)
            else:
                self.engine.abort(payload)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._inbox and not self.engine.has_work():
                    self._wake.wait()
                if self._stop:
                    self.engine.runner.close()   # multi-host: release the followers
                    return
            self._await_launch_window()
            self._drain_inbox()
            try:
                events = self.engine.step()
            except Exception as e:  # a failed device step: fail its requests, keep serving
                if self.spans_processes:   # ... unless the processes may be out of step
                    self._fail_for_good(e)
                    return
                log.exception("engine step failed")
                self.last_error = f"{type(e).__name__}: {e}"
                events = self._recover(self.last_error)
            self._stats = self._snapshot()
            for event in events:
                self._deliver(event)

    def _await_launch_window(self) -> None:
        """Pipelined, the next step is scheduled while the device still runs the last one; a
        request arriving meanwhile would wait for the step after.  So the thread waits until
        shortly (LAUNCH_LEAD_S) before the step in flight is expected to end — or it ends, or
        the engine stops — and only then schedules: arrivals during the step join the next
        one, and the host's scheduling still overlaps the device's last milliseconds.  Behind
        a step shorter than MIN_WINDOW_STEP_S it schedules at once."""
        until = self.engine.next_launch_at(LAUNCH_LEAD_S, MIN_WINDOW_STEP_S)
        while until is not None:
            left = until - time.monotonic()
            if left <= 0 or self._stop or self.engine.in_flight_ready():
                return
            with self._wake:
                self._wake.wait(min(left, POLL_S))

    def _recover(self, error: str) -> list[EngineEvent]:
        """After a failed step: the engine fails what was in flight.  Should that raise too,
        every request this engine holds ends with the error (none is left waiting on a step
        that will not come) and the thread goes on serving new ones."""
        try:
            return self.engine.fail_in_flight(error)
        except Exception:
            log.exception("recovering from the failed step failed: ending every request")
        with self._wake:
            rids = sorted(self._waiters)
        for rid in rids:
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %r after a failed recovery failed", rid)
        return [EngineEvent(rid, finish_reason="error", error=error) for rid in rids]

    def _fail_for_good(self, e: BaseException, error: str | None = None) -> None:
        """The engine cannot go on (its warm-up failed, or a multi-host step did): end every
        request with an explicit error, refuse new ones, and tell `wait_failed()`.  No reset
        (on a multi-host mesh it would be a broadcast to the dead peer)."""
        import jax

        if error is None:
            error = (f"a step on the mesh over {jax.process_count()} processes failed: a peer "
                     f"process died or stopped answering, or the processes fell out of step; "
                     f"this engine stops ({type(e).__name__}: {e})")
        log.error("process %d: %s", jax.process_index(), error, exc_info=e)
        with self._wake:
            self.fatal_error = self.last_error = error
            waiters, self._waiters = dict(self._waiters), {}
            calls = [p for kind, p in self._inbox if kind == "call"]
            self._inbox.clear()
        for rid, waiter in waiters.items():
            waiter.send(EngineEvent(rid, finish_reason="error", error=error))
        if not self._failed.done():
            self._failed.set_result(error)
        for _, call in calls:
            call.set_exception(RuntimeError(error))

