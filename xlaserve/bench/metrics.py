"""What one system's run produced and how it is summarised.

    system run --RequestOutcome per request (tokens, completion time)--> SystemResult
    KVWasteMeter.sample(now, allocated, unwritten) at every device step --> time-averaged waste

Latency is a request's completion time measured from the start of the run (every request of an
offline workload arrives at time 0).  Output tokens count only each request's own tokens: rows a
static batch keeps decoding after their request ended produce work, not output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xlaserve.bench.workload import Workload


@dataclass(frozen=True)
class RequestOutcome:
    request_id: str
    token_ids: tuple[int, ...]
    latency_s: float              # completion time since the run started


@dataclass
class KVWasteMeter:
    """Allocated-but-unwritten KV slots over allocated slots, averaged over wall time: each
    sample holds until the next one (or `finish`)."""

    _last: tuple[float, int, int] | None = None
    _allocated_time: float = 0.0   # slot-seconds allocated
    _unwritten_time: float = 0.0   # slot-seconds allocated but holding no request's own token
    peak_allocated: int = 0        # slots

    def sample(self, now: float, allocated: int, unwritten: int) -> None:
        assert 0 <= unwritten <= allocated, (unwritten, allocated)
        self._close(now)
        self._last = (now, allocated, unwritten)
        self.peak_allocated = max(self.peak_allocated, allocated)

    def finish(self, now: float) -> None:
        self._close(now)
        self._last = None

    def _close(self, now: float) -> None:
        if self._last is not None:
            t, allocated, unwritten = self._last
            self._allocated_time += allocated * (now - t)
            self._unwritten_time += unwritten * (now - t)

    @property
    def waste(self) -> float:
        return self._unwritten_time / self._allocated_time if self._allocated_time else 0.0


@dataclass
class SystemResult:
    system: str
    wall_s: float
    outcomes: dict[str, RequestOutcome]
    kv_waste: float | None = None          # time-averaged, see KVWasteMeter
    kv_peak_slots: int | None = None
    compiles_after_warmup: int | None = None
    warmup_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def check(self, workload: Workload) -> None:
        """Every request produced exactly its own number of tokens (ValueError otherwise)."""
        wrong = {r.request_id: (len(self.outcomes[r.request_id].token_ids)
                                if r.request_id in self.outcomes else None, r.num_output_tokens)
                 for r in workload.requests
                 if r.request_id not in self.outcomes
                 or len(self.outcomes[r.request_id].token_ids) != r.num_output_tokens}
        if wrong:
            raise ValueError(f"{self.system}: (produced, expected) tokens differ for "
                             f"{dict(list(wrong.items())[:5])} ({len(wrong)} requests)")

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outcomes.values())

    def summary(self) -> dict[str, Any]:
        lat = np.array([o.latency_s for o in self.outcomes.values()])
        wall = max(self.wall_s, 1e-9)
        return {
            "system": self.system,
            "requests": len(self.outcomes),
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens / wall,
            "requests_per_s": len(self.outcomes) / wall,
            "latency_mean_s": float(lat.mean()),
            "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p99_s": float(np.percentile(lat, 99)),
            "kv_waste": self.kv_waste,
            "kv_peak_slots": self.kv_peak_slots,
            "compiles_after_warmup": self.compiles_after_warmup,
            "warmup_s": self.warmup_s,
            **self.notes,
        }

    def per_request(self) -> dict[str, dict[str, Any]]:
        return {rid: {"num_tokens": len(o.token_ids), "latency_s": o.latency_s,
                      "token_ids": list(o.token_ids)} for rid, o in self.outcomes.items()}


class Clock:
    """Seconds since construction (the run's time 0)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
