"""The engine's clocks: how long the device takes per bucket (`StepClock`, which the launch
window and the admission cost model read) and how long the host takes per phase of a step
(`HostTime`, which `bench` prints).  Host-only: time.monotonic / perf_counter figures."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class HostTime:
    """Seconds the engine thread spends per phase of its steps (for `bench`; no device time
    but `wait`, the time blocked reading a step's tokens back)."""

    steps: int = 0
    schedule: float = 0.0     # scheduler.schedule
    launch: float = 0.0       # rows -> flat batch -> device arrays -> the compiled call
    process: float = 0.0      # tokens -> detokenize, stop checks, events (after the wait)
    wait: float = 0.0         # blocked in fetch: the device had not finished the step
    masks: float = 0.0        # constrained rows' allowed-token masks (grammars on the host)
    nested: float = 0.0       # of `launch`: the steps processed inside it, before the masks

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {k: 1e3 * getattr(self, k) / n for k in ("schedule", "launch", "process",
                                                        "wait", "masks")}


class StepClock:
    """How long the device takes per bucket, learnt from the steps (an exponential average of
    each step's device time: from when it could start, its launch or the previous step's
    end, to when its tokens were ready), and when the step in flight should end."""

    def __init__(self, weight: float = 0.3):
        self.weight = weight
        self.seconds: dict[tuple[int, int, int], float] = {}
        self.device_free_at = 0.0   # when the last fetched step ended

    def record(self, bucket: tuple[int, int, int], launched_at: float, done_at: float) -> float:
        """A step of `bucket` launched at `launched_at` ended at `done_at`: its device time."""
        took = done_at - max(launched_at, self.device_free_at)
        old = self.seconds.get(bucket)
        self.seconds[bucket] = took if old is None else old + self.weight * (took - old)
        self.device_free_at = done_at
        return took

    def fetched(self, bucket: tuple[int, int, int], launched_at: float,
                waited: bool) -> float | None:
        """A step's tokens were read back: had the engine to wait for them, the device was
        busy until now, a measure of its time (returned); otherwise it ended at some unknown
        point since its launch (no measure: None)."""
        if not waited:
            self.device_free_at = max(self.device_free_at, launched_at)
            return None
        return self.record(bucket, launched_at, time.monotonic())

    def expected_end(self, bucket: tuple[int, int, int], launched_at: float) -> float | None:
        took = self.seconds.get(bucket)
        return None if took is None else max(launched_at, self.device_free_at) + took
