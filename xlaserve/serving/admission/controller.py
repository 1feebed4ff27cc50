"""Admission control for one model: at most `capacity` engine requests in the engines at once
(a client request with n choices weighs n), a bounded priority queue in front, and a wait
estimate from Little's law.

    arrive --(slot free, nobody ahead)--> run
           --(queue full / expected wait > tier SLO)--> Rejected(429, Retry-After)
           --(otherwise)--> queued, ordered by (tier, priority, arrival) --> run
                                    |-- waited max_queue_wait_s --> Rejected("timeout")
                                    |-- displaced by a higher tier when full --> Rejected
    run --release()--> next in queue

Expected wait of a newcomer = (weight ahead of it + its weight) / service rate  (Little's law,
W = L/λ),
where "ahead" counts only queued requests that would be served before it (paid before free),
and the service rate is the larger of the engines' measured completion rate and
capacity / (mean measured time in the engine); before anything is measured,
`initial_service_rate` per replica.  Retry-After is the time for the queue to drain to where
the wait fits the SLO: expected wait - SLO, at least 1 s.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from xlaserve.serving.server_config import AdmissionConfig
from xlaserve.serving.types import Tier


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
    started: float = 0.0
    queue_time: float = 0.0
    released: bool = False


@dataclass(order=True)
class _Waiter:
    key: tuple[int, int, int]          # (-tier, -priority, seq): smallest is served first
    ticket: Ticket = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)


class AdmissionController:
    def __init__(self, config: AdmissionConfig, capacity: int, max_queue: int,
                 replicas: int = 1, engine_rate: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic):
        assert capacity >= 1 and max_queue >= 0
        self.config = config
        self.capacity = capacity
        self.max_queue = max_queue
        self.replicas = replicas
        self._engine_rate = engine_rate
        self._clock = clock
        self._running = 0
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self._mean_service_s = 0.0          # EWMA of time from admit to release
        self.rejections: Counter[str] = Counter()

    # -- observability ---------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._queue if not w.future.done())

    def service_rate(self) -> float:
        """Requests/s the engines are expected to finish (see module docstring)."""
        rates = [self._engine_rate()]
        if self._mean_service_s > 0:
            rates.append(self.capacity / self._mean_service_s)
        rate = max(rates)
        return rate if rate > 0 else self.config.initial_service_rate * self.replicas

    def _fits(self, weight: int) -> bool:
        # A request heavier than the whole capacity still runs, alone.
        return self._running + weight <= self.capacity or self._running == 0

    def expected_wait(self, tier: Tier, priority: int = 0, weight: int = 1) -> float:
        ahead = sum(w.ticket.weight for w in self._queue if not w.future.done()
                    and (w.ticket.tier, w.ticket.priority) >= (tier, priority))
        if ahead == 0 and self._fits(weight):
            return 0.0
        return (ahead + weight) / self.service_rate()

    # -- admission -------------------------------------------------------------------------

    async def acquire(self, tier: Tier, priority: int = 0, weight: int = 1) -> Ticket:
        """Wait for `weight` slots or raise Rejected.  Cancelling the caller leaves the queue
        clean."""
        assert weight >= 1
        now = self._clock()
        ticket = Ticket(tier, priority, now, weight)
        self._queue = [w for w in self._queue if not w.future.done()]
        heapq.heapify(self._queue)
        if not self._queue and self._fits(weight):
            return self._start(ticket)
        wait = self.expected_wait(tier, priority, weight)
        slo = self.config.slo(tier)
        if wait > slo:
            raise self._reject("slo", wait - slo,
                               f"expected queue wait {wait:.1f}s exceeds the {tier.name.lower()} "
                               f"tier's {slo:g}s objective")
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
                raise self._reject("queue_full", wait,
                                   f"admission queue is full ({self.max_queue} waiting)")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter((-int(tier), -priority, next(self._seq)), ticket, fut)
        heapq.heappush(self._queue, waiter)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.config.max_queue_wait_s)
        except TimeoutError:
            # The timer and the grant can land in the same loop iteration: wait_for then
            # raises although _wake() already started the ticket.  The caller is still
            # here, so it is admitted (rejecting it would leak the slot or waste the grant).
            if self._granted(fut):
                return ticket
            self._drop(waiter)
            raise self._reject("timeout", self.expected_wait(tier, priority, weight),
                               f"waited {self.config.max_queue_wait_s:g}s in the admission "
                               "queue") from None
        except BaseException:
            # Cancelled (client gone) or displaced.  If we were granted a slot in the same
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
        elapsed = self._clock() - ticket.started  # per engine request: they run side by side
        self._mean_service_s = (elapsed if self._mean_service_s == 0
                                else 0.8 * self._mean_service_s + 0.2 * elapsed)
        self._give_back(ticket)

    # -- internals -------------------------------------------------------------------------

    def _start(self, ticket: Ticket) -> Ticket:
        self._running += ticket.weight
        ticket.started = self._clock()
        ticket.queue_time = ticket.started - ticket.arrived
        return ticket

    @staticmethod
    def _granted(fut: asyncio.Future[None]) -> bool:
        return fut.done() and not fut.cancelled() and fut.exception() is None

    def _give_back(self, ticket: Ticket) -> None:
        """Free the ticket's slots; unlike release(), no service time is measured (a ticket
        granted to a caller that had already gone never ran)."""
        assert not ticket.released
        ticket.released = True
        self._running -= ticket.weight
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
            self._start(w.ticket)
            w.future.set_result(None)

    def _drop(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
            heapq.heapify(self._queue)
        if not waiter.future.done():
            waiter.future.cancel()
        self._wake()  # it may have been the head that did not fit

    def _reject(self, reason: str, retry_after: float, message: str) -> Rejected:
        self.rejections[reason] += 1
        return Rejected(reason, max(1.0, math.ceil(retry_after)), message)
