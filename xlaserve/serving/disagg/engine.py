"""`DisaggregatedEngine`: one replica to the router, made of prefill workers and decode
workers (each an `xlaserve worker` behind a RemoteEngine); the AsyncEngine protocol.

    submit(request)
      1. a prefill worker runs the prompt to its first token (affinity.py: the live one
         that last prefilled the prompt's longest cached prefix, unless it is much busier
         than the least loaded; else the least loaded):
         the request with max_tokens 1 and `continues` (text held back stays held)
         -> the first token's event goes to the client at once (time to first token)
         meanwhile the decode worker (the least loaded live one, picked now) prefetches the
         prompt's KV from that prefill worker as its chunks finish (PrefetchKV: ExportKV
         following the request), adopting each batch of blocks into its prefix cache
      2. the decode worker gets the request with that token as its output so far, once the
         prefetch is done: with no `kv_source` when every full block came, else with
         `kv_source` = the prefill worker, whose ExportKV sends the rest; it decodes the rest
         -> its events follow; the final usage is the decode side's, with the prefill side's
            prefix-cache hits as `cached_tokens`; the first carries the KV moved (both
            fetches) and the time the transfer added after the prefill (the wait for the
            prefetch to end, plus the decode worker's own fetch)

A request that ends at its first token (a stop token, max_tokens 1, the context full) never
reaches a decode worker.  A prefill worker that fails before the first token (gone, refused,
an error event) is retried once on another live prefill worker; a decode worker that fails
ends the request with its error event, naming the worker.  Blocks are never held for the
handoff on either side (engine/kv_handoff.py), so an abort or a dead worker at any point
leaks nothing: the request's blocks on each worker are freed by that worker's own abort or
finish, and a decode worker still fetching the KV drops the request before its engine sees
it (grpc/server.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence

from xlaserve.serving.disagg.affinity import PrefixAffinity
from xlaserve.serving.engine_api import EngineStats, ServiceCosts
from xlaserve.serving.grpc.client import RemoteEngine
from xlaserve.serving.types import EngineEvent, GenerationRequest, KVHandoff, Usage

PREFETCH_TIMEOUT_S = 60.0   # a PrefetchKV call, the prompt's prefill included


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """A split request's KV prefetch: the decode worker taking it, and its PrefetchKV call
    ((what moved, whether every full block came))."""

    worker: RemoteEngine
    task: asyncio.Future[tuple[KVHandoff, bool]]


class DisaggregatedEngine:
    def __init__(self, prefill: Sequence[RemoteEngine], decode: Sequence[RemoteEngine],
                 model_name: str, block_size: int = 16):
        if not prefill or not decode:
            raise ValueError(f"a disaggregated replica needs prefill and decode workers, got "
                             f"{len(prefill)} and {len(decode)}")
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.model_name = model_name
        self.tokenizer = self.decode[0].tokenizer
        self._where: dict[str, list[RemoteEngine]] = {}   # request id -> workers it is on
        self.affinity = PrefixAffinity(block_size)
        self.block_size = block_size
        self._prefetch: dict[str, Prefetch] = {}   # request id -> its KV prefetch
        self._aborted: set[str] = set()   # requests aborted here (none of their parts left)
        # parts this engine has on each worker now: exact, unlike the polled stats
        self._parts: dict[str, int] = {w.target: 0 for w in self.workers}

    @property
    def workers(self) -> list[RemoteEngine]:
        return self.prefill + self.decode

    @property
    def ready(self) -> bool:
        return any(w.ready for w in self.prefill) and any(w.ready for w in self.decode)

    @property
    def max_model_len(self) -> int:
        return min(w.max_model_len for w in self.workers)

    async def start(self) -> None:
        await asyncio.gather(*(w.start() for w in self.workers))

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers))

    def stats(self) -> EngineStats:
        """The decode workers' load (where requests spend their time), both sides' caches."""
        d = [w.stats() for w in self.decode]
        p = [w.stats() for w in self.prefill]
        return EngineStats(
            num_running=sum(s.num_running for s in d),
            num_waiting=sum(s.num_waiting for s in d + p),
            kv_blocks_total=sum(s.kv_blocks_total for s in d + p),
            kv_blocks_used=sum(s.kv_blocks_used for s in d + p),
            kv_blocks_cached=sum(s.kv_blocks_cached for s in d + p),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in p),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in p),
            num_preemptions=sum(s.num_preemptions for s in d + p),
            num_finished=sum(s.num_finished for s in d))

    def service_costs(self) -> ServiceCosts:
        """Decode steps cost what the decode workers' do; prompts go at the prefill workers'
        summed rate."""
        d = [w.service_costs() for w in self.decode]
        p = [w.service_costs() for w in self.prefill]
        return ServiceCosts(sum(c.max_running for c in d),
                            max((c.step_s for c in d), default=0.0),
                            sum(c.prefill_tokens_per_s for c in p))

    def _load(self, w: RemoteEngine) -> int:
        s = w.stats()
        return max(s.num_running + s.num_waiting, self._parts[w.target])

    def _pick_decode(self) -> RemoteEngine | None:
        return min((w for w in self.decode if w.ready), key=self._load, default=None)

    def _pick_prefill(self, hashes: Sequence[bytes], avoid: RemoteEngine | None
                      ) -> RemoteEngine | None:
        live = [w for w in self.prefill if w.ready and w is not avoid]
        if not live:
            return None
        target = self.affinity.choose([w.target for w in live], [self._load(w) for w in live],
                                      hashes)
        return next(w for w in live if w.target == target)

    async def _run_part(self, worker: RemoteEngine, part: GenerationRequest, kv_source: str = ""
                        ) -> AsyncIterator[EngineEvent]:
        """`worker.submit(part)`, counted in this engine's load of `worker` while it runs."""
        self._parts[worker.target] += 1
        try:
            async for ev in worker.submit(part, kv_source=kv_source):
                yield ev
        finally:
            self._parts[worker.target] -= 1

    async def submit(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        rid = request.request_id
        if rid in self._where:
            raise ValueError(f"request_id {rid!r} is already in use")
        self._where[rid] = []
        try:
            first, source = await self._prefill(request)
            if first.error is not None or self._ends_at_first(request, first):
                yield first
                return
            yield dataclasses.replace(first, finish_reason=None, usage=None)
            async for ev in self._decode(request, first, source):
                yield ev
        finally:
            self._where.pop(rid, None)
            self._aborted.discard(rid)
            self._stop_prefetch(rid)

    def _start_prefetch(self, request: GenerationRequest, source: RemoteEngine) -> None:
        """Have a decode worker fetch the prompt's KV from `source` while it prefills (not
        for a prompt without a full block, nor one ending at its first token)."""
        decode = self._pick_decode()
        if (decode is None or request.sampling.max_tokens <= 1
                or len(request.prompt_token_ids) < self.block_size):
            return
        self._prefetch[request.request_id] = Prefetch(decode, asyncio.ensure_future(
            decode.prefetch(request, source.target, PREFETCH_TIMEOUT_S)))

    def _stop_prefetch(self, request_id: str) -> None:
        prefetch = self._prefetch.pop(request_id, None)
        if prefetch is not None:
            prefetch.task.cancel()

    async def _prefetched(self, request_id: str, worker: RemoteEngine
                          ) -> tuple[KVHandoff | None, bool, bool]:
        """(handoff, complete, aborted) of the request's prefetch once it ends, if `worker`
        took it; the handoff's seconds are the wait here (what it added after the prefill)."""
        prefetch = self._prefetch.get(request_id)
        if prefetch is None or prefetch.worker is not worker:
            return None, False, False
        t0 = time.monotonic()
        await asyncio.wait({prefetch.task})
        if prefetch.task.cancelled() or request_id in self._aborted:
            return None, False, True
        handoff, complete = prefetch.task.result()
        return dataclasses.replace(handoff, seconds=time.monotonic() - t0), complete, False

    def _ends_at_first(self, request: GenerationRequest, first: EngineEvent) -> bool:
        """Did the prefill side's finish end the request itself (a stop, not just its
        one-token budget)?"""
        if first.finish_reason != "length":
            return True
        return (request.sampling.max_tokens <= 1
                or len(request.prompt_token_ids) + 1 >= self.max_model_len)

    async def _prefill(self, request: GenerationRequest) -> tuple[EngineEvent, RemoteEngine]:
        """The first token's event (finished: its worker's final event) and the worker; one
        retry on another prefill worker when the first fails without a token."""
        part = dataclasses.replace(request, continues=True, sampling=dataclasses.replace(
            request.sampling, max_tokens=1))
        hashes = self.affinity.hashes(request.prompt_token_ids, request.tenant)
        tried: RemoteEngine | None = None
        for _ in range(2):
            worker = self._pick_prefill(hashes, avoid=tried)
            if worker is None:
                break
            tried = worker
            self._where[request.request_id] = [worker]
            self._start_prefetch(request, worker)
            events = [ev async for ev in self._run_part(worker, part)]
            first = _merge(events)
            if first.error is None or first.token_ids:
                self.affinity.record(worker.target, hashes)
                return first, worker
            self._stop_prefetch(request.request_id)
        error = "no prefill worker could run the prompt" + (
            f" (last: {first.error})" if tried is not None else " (none is ready)")
        return EngineEvent(request.request_id, finish_reason="error", error=error,
                           usage=Usage(len(request.prompt_token_ids), 0)), tried

    async def _decode(self, request: GenerationRequest, first: EngineEvent,
                      source: RemoteEngine) -> AsyncIterator[EngineEvent]:
        prefetch = self._prefetch.get(request.request_id)
        worker = (prefetch.worker if prefetch is not None and prefetch.worker.ready
                  else self._pick_decode())
        if worker is None:
            yield EngineEvent(request.request_id, finish_reason="error",
                              error="no decode worker is ready", usage=first.usage)
            return
        self._where[request.request_id] = [worker]
        handoff, complete, aborted = await self._prefetched(request.request_id, worker)
        if aborted:
            yield EngineEvent(request.request_id, finish_reason="abort", usage=first.usage)
            return
        part = dataclasses.replace(request, output_token_ids=first.token_ids)
        cached = first.usage.cached_tokens if first.usage is not None else 0
        source_kv = "" if complete else source.target
        async for ev in self._run_part(worker, part, kv_source=source_kv):
            if handoff is not None:
                ev = dataclasses.replace(ev, kv_handoff=_added(handoff, ev.kv_handoff))
                handoff = None
            if ev.error is not None:
                said = (ev.error if ev.error.startswith(worker.target)
                        else f"{worker.target}: {ev.error}")
                ev = dataclasses.replace(ev, error=f"decode worker {said}")
            if ev.usage is not None:
                ev = dataclasses.replace(ev, usage=dataclasses.replace(ev.usage,
                                                                       cached_tokens=cached))
            yield ev

    async def abort(self, request_id: str) -> None:
        prefetch = self._prefetch.get(request_id)
        if prefetch is not None:   # its decode part, not sent yet, never will be
            self._aborted.add(request_id)
            prefetch.task.cancel()
        for w in self._where.get(request_id, []):
            await w.abort(request_id)


def _merge(events: Sequence[EngineEvent]) -> EngineEvent:
    """A one-token request's events as one (its tokens, text, logprobs; the final's reason,
    usage and error)."""
    if not events:
        return EngineEvent("", finish_reason="error", error="no events")
    last = events[-1]
    return dataclasses.replace(
        last, token_ids=tuple(t for e in events for t in e.token_ids),
        text="".join(e.text for e in events),
        logprobs=tuple(lp for e in events for lp in e.logprobs))


def _added(a: KVHandoff, b: KVHandoff | None) -> KVHandoff:
    """The prefetch's handoff and the decode worker's own fetch's, as one."""
    if b is None:
        return a
    return KVHandoff(a.blocks + b.blocks, a.nbytes + b.nbytes, a.seconds + b.seconds)
