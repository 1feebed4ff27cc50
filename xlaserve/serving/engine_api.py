"""The one interface the front ends (HTTP, gRPC, router, admission) need from an engine.

    front end --GenerationRequest--> engine.submit(request) --EngineEvent...--> front end
                                     engine.abort(request_id)
                                     engine.stats() / engine.service_costs()  (admission, metrics)

Protocol (what every implementation promises):

- `submit(request)` returns an async iterator of `EngineEvent`s for that request.  Every
  request whose iterator was started ends with exactly one event whose `finish_reason` is set
  ("stop" | "length" | "abort" | "error"); no event follows it.  The final event carries `usage`.
  Text deltas concatenate to the completion text (stop strings already cut off).
- `abort(request_id)` is idempotent and a no-op for unknown or finished requests.  After it
  returns, the request's KV blocks are freed (or will be at the very next step) and its stream,
  if anyone still reads it, ends with finish_reason "abort".  The front ends call it whenever
  they stop reading a stream early (client gone, deadline, error); they may also just close
  the iterator, which an engine must treat the same way.
- A request id names one request at a time: `submit` refuses (ValueError) the id of a running
  request.  Once a request finished, or was aborted and its stream closed, its id may be
  submitted again; the local engine also takes it right after `abort` returned (it holds the
  new request until its thread has let go of the old one, whose events never reach it).
- `stats()` is cheap and synchronous (read at every /metrics scrape and routing decision).
- `service_costs()` is what a step of the engine costs, measured (`ServiceCosts`): admission
  projects from it how long a new request would wait (admission/projection.py).  Cheap and
  synchronous, like stats().

Optional: an engine may define `async start()` / `async stop()`; the HTTP app and the gRPC
server call them once in their serving event loop (before the first / after the last request).

Implementations: the local continuous-batching engine, `serving.grpc.client.RemoteEngine`
(a replica behind gRPC), and the tests' FakeEngine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import EngineEvent, GenerationRequest


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load and KV-cache state."""

    num_running: int = 0              # requests with KV blocks, stepping now
    num_waiting: int = 0              # accepted, not yet running (incl. preempted)
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0           # referenced by a live request
    kv_blocks_cached: int = 0         # free but still holding a reusable prefix
    prefix_cache_queries: int = 0     # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0        # of those, tokens found (cumulative)
    num_preemptions: int = 0          # cumulative
    num_finished: int = 0             # cumulative, any finish_reason
    spec_num_drafts: int = 0          # speculative verify rows run (cumulative)
    spec_num_draft_tokens: int = 0    # draft tokens verified (cumulative)
    spec_num_accepted_tokens: int = 0  # of those, accepted (cumulative)
    # spec_acceptance_counts[a]: verify rows that accepted exactly a drafts (cumulative)
    spec_acceptance_counts: tuple[int, ...] = ()

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0


@dataclass(frozen=True)
class ServiceCosts:
    """What the engine's steps cost, measured on it: in warm-up, then a moving estimate over
    the steps it serves.  Zeros: not measured (yet)."""

    max_running: int = 0              # sequences one step carries at most
    step_s: float = 0.0               # seconds per decode step of a full batch
    prefill_tokens_per_s: float = 0.0  # prompt tokens a step prefills per second

    @property
    def measured(self) -> bool:
        return self.max_running > 0 and self.step_s > 0 and self.prefill_tokens_per_s > 0


@runtime_checkable
class AsyncEngine(Protocol):
    """An engine serving one model (see the module docstring for the stream protocol)."""

    model_name: str           # the model id the engine serves (config name, not a path)
    tokenizer: Tokenizer      # the front ends tokenize prompts and render chat templates
    max_model_len: int        # prompt + completion tokens must fit in this

    @property
    def ready(self) -> bool:
        """True once warm-up (compilation, weight load) is done and requests are served."""
        ...

    def submit(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        """Start `request`; iterate its events until the one with finish_reason set."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks (idempotent)."""
        ...

    def stats(self) -> EngineStats:
        """Current load and cache counters."""
        ...

    def service_costs(self) -> ServiceCosts:
        """The engine's measured step costs."""
        ...
