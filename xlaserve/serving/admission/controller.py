"""Admission control for one model: at most `max_inflight` engine requests per live replica in
the engines at once (a client request with n choices weighs n), a bounded priority queue in
front, and a work-based projection of each newcomer's wait (projection.py).

    arrive --(expected wait > tier SLO)--> Rejected(429 "slo", Retry-After)
           --(a lane free, nobody ahead)--> run
           --(queue full)--> Rejected(429 "queue_full")
           --(otherwise)--> queued, ordered by (tier, priority, arrival) --> run
                                    |-- waited its tier's SLO --> Rejected("timeout")
                                    |-- displaced by a higher tier when full --> Rejected
    run --release()--> next in queue

Expected wait = the projection of when the engines would start the newcomer, from the work of
every request in them (prompt + max_tokens, less what their time there has done) and of the
queued ones served before it (paid before free), over the live replicas' measured step costs
(`AsyncEngine.service_costs()`: measured in warm-up, then a moving estimate from the steps
served).  Retry-After is the time until the wait fits the SLO again (expected wait - SLO), plus
the share of the engines' time booked by the requests turned away before it, so that a burst's
retries come back spread out; rounded up, at least 1 s, at most a minute.

The capacity follows the live replicas: a replica that goes down takes its `max_inflight` and
its sequence lanes out of both.  The projection can be wrong (a machine busier than when it was
measured); the SLO then still bounds the wait: a request still queued when its tier's SLO has
passed is turned away ("timeout"), so no admitted request waited in the queue longer than its
SLO (or max_queue_wait_s, if shorter).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from xlaserve.serving.admission.projection import Rates, Work, queue_wait
from xlaserve.serving.engine_api import ServiceCosts
from xlaserve.serving.server_config import AdmissionConfig
from xlaserve.serving.types import Tier

RETRY_AFTER_MAX_S = 60.0


class Rejected(Exception):
    """429: not admitted.  `reason` is one of queue_full, slo, timeout, displaced."""

    def __init__(self, reason: str, retry_after: float, message: str):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


@dataclass
class Ticket:
    tier: Tier
    priority: int
    arrived: float
    weight: int = 1
    work: Work = Work()           # of each of its `weight` engine requests
    started: float = 0.0
    queue_time: float = 0.0
    released: bool = False


@dataclass(order=True)
class _Waiter:
    key: tuple[int, int, int]          # (-tier, -priority, seq): smallest is served first
    ticket: Ticket = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    deadline: float = field(compare=False, default=math.inf)   # clock time its bound ends


class AdmissionController:
    def __init__(self, config: AdmissionConfig, max_inflight: int, max_queue: int,
                 replicas: Callable[[], Sequence[ServiceCosts]] = lambda: (ServiceCosts(),),
                 clock: Callable[[], float] = time.monotonic):
        """`replicas()`: the step costs of each live replica of the model (one entry per
        replica that is up; the costs may be unmeasured: no projection from that one)."""
        if max_inflight < 1 or max_queue < 0:
            raise ValueError(f"max_inflight={max_inflight} must be >= 1 and "
                             f"max_queue={max_queue} >= 0")
        self.config = config
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self._replicas = replicas
        self._clock = clock
        self._running = 0
        self._started: dict[int, Ticket] = {}   # id(ticket) -> ticket, oldest first
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self._retry_at = 0.0                    # see _retry_after
        self.rejections: Counter[str] = Counter()

    # -- observability ---------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._queue if not w.future.done())

    @property
    def capacity(self) -> int:
        """Engine requests the live replicas may hold at once."""
        return self.max_inflight * max(1, len(self._replicas()))

    def rates(self) -> Rates | None:
        """The live replicas' measured costs, pooled (None: nothing measured yet): their
        sequence lanes, the slowest step, prefill rates summed (they prefill side by side)."""
        known = [c for c in self._replicas() if c.measured]
        if not known:
            return None
        # the engines never hold more than the capacity: beyond it, lanes stay empty
        return Rates(lanes=min(sum(c.max_running for c in known), self.capacity),
                     step_s=max(c.step_s for c in known),
                     prefill_tokens_per_s=sum(c.prefill_tokens_per_s for c in known))

    def _fits(self, weight: int) -> bool:
        # A request heavier than the whole capacity still runs, alone.
        return self._running + weight <= self.capacity or self._running == 0

    def expected_wait(self, tier: Tier, priority: int = 0, weight: int = 1) -> float:
        """Seconds until the engines would start a request of this class arriving now."""
        rates = self.rates()
        if rates is None:
            return 0.0
        now = self._clock()
        running = [(t.work, now - t.started) for t in self._started.values()
                   for _ in range(t.weight)]
        ahead = [w.ticket.work for w in sorted(self._queue) if not w.future.done()
                 and (w.ticket.tier, w.ticket.priority) >= (tier, priority)
                 for _ in range(w.ticket.weight)]
        return queue_wait(rates, running, ahead, weight)

    # -- admission -------------------------------------------------------------------------

    async def acquire(self, tier: Tier, priority: int = 0, weight: int = 1,
                      work: Work = Work()) -> Ticket:
        """Wait for `weight` lanes (engine requests, each costing `work`) or raise Rejected.
        Cancelling the caller leaves the queue clean."""
        assert weight >= 1
        now = self._clock()
        ticket = Ticket(tier, priority, now, weight, work)
        self._queue = [w for w in self._queue if not w.future.done()]
        heapq.heapify(self._queue)
        wait = self.expected_wait(tier, priority, weight)
        slo = self.config.slo(tier)
        bound = min(slo, self.config.max_queue_wait_s)   # no admitted request waits longer
        if wait > slo:
            raise self._reject("slo", self._retry_after(wait - slo, weight, work),
                               f"expected queue wait {wait:.1f}s exceeds the {tier.name.lower()} "
                               f"tier's {slo:g}s objective")
        if not self._queue and self._fits(weight):
            return self._start(ticket)
        if len(self._queue) >= self.max_queue:
            worst = max(self._queue) if self._queue else None   # max_queue = 0: no queue
            if worst is not None and worst.key > (-tier, -priority, math.inf):
                # Full, but someone of a lower class is queued: they make way (paid before free).
                self._queue.remove(worst)
                heapq.heapify(self._queue)
                self.rejections["displaced"] += 1
                worst.future.set_exception(Rejected(
                    "displaced", max(1.0, wait),
                    "queued request displaced by a higher-priority one; retry later"))
            else:
                raise self._reject("queue_full", self._retry_after(wait, weight, work),
                                   f"admission queue is full ({self.max_queue} waiting)")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter((-int(tier), -priority, next(self._seq)), ticket, fut, now + bound)
        heapq.heappush(self._queue, waiter)
        try:
            await asyncio.wait_for(asyncio.shield(fut), bound)
        except TimeoutError:
            # The timer and the grant can land in the same loop iteration: wait_for then
            # raises although _wake() already started the ticket.  The caller is still
            # here, so it is admitted (rejecting it would leak the lane or waste the grant).
            if self._granted(fut):
                return ticket
            # or turned away in that iteration (displaced, or its bound passed): counted once
            turned_away = fut.exception() if fut.done() and not fut.cancelled() else None
            self._drop(waiter)
            raise (turned_away or self._timed_out(ticket, bound)) from None
        except BaseException:
            # Cancelled (client gone) or displaced.  If we were granted a lane in the same
            # instant, hand it on without counting it as a served request.
            if self._granted(fut):
                self._give_back(ticket)
            else:
                self._drop(waiter)
            raise
        return ticket

    def release(self, ticket: Ticket) -> None:
        """The request left the engine (any outcome).  Idempotent."""
        if ticket.released:
            return
        self._give_back(ticket)

    # -- internals -------------------------------------------------------------------------

    def _start(self, ticket: Ticket) -> Ticket:
        self._running += ticket.weight
        self._started[id(ticket)] = ticket
        ticket.started = self._clock()
        ticket.queue_time = ticket.started - ticket.arrived
        return ticket

    @staticmethod
    def _granted(fut: asyncio.Future[None]) -> bool:
        return fut.done() and not fut.cancelled() and fut.exception() is None

    def _give_back(self, ticket: Ticket) -> None:
        """Free the ticket's lanes (also for a ticket granted to a caller that had already
        gone, which never ran)."""
        assert not ticket.released
        ticket.released = True
        self._running -= ticket.weight
        del self._started[id(ticket)]
        self._wake()

    def _wake(self) -> None:
        # Strictly in order: the head waits until it fits, so heavy requests never starve.
        while self._queue:
            w = self._queue[0]
            if w.future.done():
                heapq.heappop(self._queue)
                continue
            if not self._fits(w.ticket.weight):
                return
            heapq.heappop(self._queue)
            if self._clock() > w.deadline:
                # Its bound passed while the loop was busy and its timer has not run yet:
                # granting it now would admit a request that waited longer than the bound.
                w.future.set_exception(self._timed_out(w.ticket, w.deadline - w.ticket.arrived))
                continue
            self._start(w.ticket)
            w.future.set_result(None)

    def _drop(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
            heapq.heapify(self._queue)
        if not waiter.future.done():
            waiter.future.cancel()
        self._wake()  # it may have been the head that did not fit

    def _retry_after(self, drain_s: float, weight: int, work: Work) -> float:
        """When a request turned away now should come back: once the queue has drained for
        `drain_s`, and after the ones turned away before it, each of which booked its share of
        the engines' time (its service over the lanes), so that a burst's retries come back
        spread at the rate the engines can take them rather than all in the same second.  At
        most RETRY_AFTER_MAX_S (a sustained overload would push the horizon ever further)."""
        now = self._clock()
        rates = self.rates()
        share = weight * rates.service_s(work) / rates.lanes if rates is not None else 0.0
        self._retry_at = max(self._retry_at, now + drain_s) + share
        return min(self._retry_at - now, RETRY_AFTER_MAX_S)

    def _timed_out(self, t: Ticket, bound: float) -> Rejected:
        return self._reject("timeout", self.expected_wait(t.tier, t.priority, t.weight),
                            f"waited {bound:g}s in the admission queue, the "
                            f"{t.tier.name.lower()} tier's objective")

    def _reject(self, reason: str, retry_after: float, message: str) -> Rejected:
        self.rejections[reason] += 1
        return Rejected(reason, max(1.0, math.ceil(retry_after)), message)
