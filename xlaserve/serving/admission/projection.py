"""How long would a new request wait before the engines start it?  A work-based projection
over the engines' measured step costs (no jax, no clock: plain numbers in, seconds out).

An engine steps up to `max_running` sequences at once; in a full batch each of them gets one
token per decode step (`step_s`), and a prompt costs `prompt_tokens / prefill_tokens_per_s` of
engine time, which stalls every stream in the batch.  So a request of p prompt tokens and m
output tokens holds a sequence lane for

    service(p, m) = p / prefill_tokens_per_s + m * step_s          seconds

and the projection plays the queue out over the lanes of every live replica:

    lanes    = one free-at time per sequence lane: the remaining service of the requests that
               hold one (service - time since they started, at least one step), 0 for free ones
    for each request ahead, in the order it will be served:
        it starts when the earliest lane frees; that lane is then busy for its service, and
        its prefill stalls everyone (added to every later start)
    newcomer's queue wait = the time its lane frees + the stalls of those started before it
    (its first token follows one prefill later)

This is Little's law counted in work rather than requests: a queue of long requests projects a
longer wait than the same number of short ones.  Output lengths are taken at `max_tokens`
(what a request may cost), so a workload that stops early is projected pessimistically and
admits conservatively.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Work:
    """What one engine request may cost: its prompt and at most this many output tokens."""

    prompt_tokens: int = 0
    max_tokens: int = 1


@dataclass(frozen=True)
class Rates:
    """Measured costs of the live replicas, pooled: `lanes` sequence lanes in all, stepping a
    full batch every `step_s` seconds and prefilling `prefill_tokens_per_s`."""

    lanes: int
    step_s: float
    prefill_tokens_per_s: float

    def prefill_s(self, work: Work) -> float:
        return work.prompt_tokens / self.prefill_tokens_per_s

    def service_s(self, work: Work) -> float:
        return self.prefill_s(work) + work.max_tokens * self.step_s


def queue_wait(rates: Rates, running: Sequence[tuple[Work, float]], ahead: Sequence[Work],
               weight: int = 1) -> float:
    """Seconds until a new request's `weight` engine requests would all have started.

    running: (work, seconds since it started) of every request in the engines, oldest first;
             beyond `rates.lanes` of them they wait in an engine's own queue (not started)
    ahead:   the queued requests that will be served before it, in order
    """
    started, queued = running[:rates.lanes], [w for w, _ in running[rates.lanes:]]
    free_at = [max(rates.step_s, rates.service_s(w) - elapsed) for w, elapsed in started]
    free_at += [0.0] * (rates.lanes - len(free_at))
    heapq.heapify(free_at)
    stall = 0.0
    for work in (*queued, *ahead):
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + rates.service_s(work))
        stall += rates.prefill_s(work)
    starts = [heapq.heappop(free_at) for _ in range(min(weight, rates.lanes))]
    return max(starts) + stall
