"""Who goes first: sort keys over sequences, smallest key = served first.

    key = (-(tier + aging), -priority, deadline, [requeued first,] arrival, add order)
    aging = floor((now - arrival_time) / aging_seconds)

Aging lifts a request one tier for every `aging_seconds` since it arrived, so a FREE request
that has waited 2 * aging_seconds ranks with INTERNAL ones and overtakes any PAID request that
arrived after it: nothing starves. `now` is always an argument; nothing here reads a clock. The
same key picks preemption victims (the largest key among running requests), so an aged request
is also protected from preemption by newer, nominally higher tiers.
"""

from __future__ import annotations

import math

from xlaserve.serving.scheduler.sequence import Sequence

PriorityKey = tuple[float, ...]


def effective_tier(seq: Sequence, now: float, aging_seconds: float) -> int:
    waited = max(0.0, now - seq.request.arrival_time)
    aging = 0 if math.isinf(aging_seconds) else math.floor(waited / aging_seconds)
    return int(seq.request.tier) + aging


def priority_key(seq: Sequence, now: float, aging_seconds: float) -> PriorityKey:
    """Running order; the largest key is the preemption victim (lowest, then latest)."""
    r = seq.request
    deadline = math.inf if r.deadline is None else r.deadline
    return (-effective_tier(seq, now, aging_seconds), -r.priority, deadline, r.arrival_time,
            seq.seq_no)


def waiting_key(seq: Sequence, now: float, aging_seconds: float) -> PriorityKey:
    """Admission order: as `priority_key`, but a preempted request goes ahead of its peers of
    equal priority (same effective tier, priority and deadline)."""
    k = priority_key(seq, now, aging_seconds)
    return k[:3] + (0 if seq.requeued else 1,) + k[3:]
