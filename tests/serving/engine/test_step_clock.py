"""The engine's step clock: it learns each bucket's device time from the steps it fetches and
says when the step in flight should end, so that AsyncEngine schedules the next step just
before then (requests arriving meanwhile join it) rather than at once."""

from __future__ import annotations

import pytest

from tests.serving.engine.conftest import new_tiny_engine, request
from xlaserve.serving.engine.step_clock import StepClock

BUCKET = (4, 4, 8)


def test_clock_averages_device_time_from_when_the_device_was_free() -> None:
    clock = StepClock(weight=0.5)
    assert clock.expected_end(BUCKET, 10.0) is None        # nothing learnt yet
    clock.record(BUCKET, launched_at=10.0, done_at=10.2)     # 0.2 s
    assert clock.seconds[BUCKET] == pytest.approx(0.2)
    # Launched while the last step still ran: its time counts from that step's end (10.2).
    clock.record(BUCKET, launched_at=10.1, done_at=10.6)     # 0.4 s
    assert clock.seconds[BUCKET] == pytest.approx(0.3)
    assert clock.expected_end(BUCKET, 10.5) == pytest.approx(10.9)   # free at 10.6, + 0.3
    assert clock.expected_end(BUCKET, 11.0) == pytest.approx(11.3)
    assert clock.expected_end((8, 8, 8), 11.0) is None


def test_next_launch_time_lies_within_the_step_in_flight(warm_tiny, monkeypatch) -> None:
    """The tiny model's steps end before the engine reads them; here every call reports itself
    still running until fetched, as a step of a real model does."""
    engine = new_tiny_engine(warm_tiny, pipelined=True)
    real = engine.runner.sample

    class Busy:   # a CallResult that reports itself running until fetched
        def __init__(self, call):
            self.call = call

        def __getattr__(self, name):
            return getattr(self.call, name)

        def ready(self) -> bool:
            return False

    def busy_sample(call, masks=None):
        return Busy(real(call, masks))

    monkeypatch.setattr(engine.runner, "sample", busy_sample)
    engine.add(request("a", list(range(1000, 1020)), max_tokens=40, ignore_eos=True))
    for _ in range(8):        # prefill, then decode steps: the decode bucket is timed
        engine.step()
    assert engine.clock.seconds, "no step time learnt"
    engine.step()
    at = engine.next_launch_at(0.0)
    last = engine._calls[engine.scheduler.in_flight[-1].step_id]
    took = engine.clock.seconds[last.call.bucket]
    assert at == max(last.launched_at, engine.clock.device_free_at) + took
    assert engine.next_launch_at(0.004) == at - 0.004
    assert engine.next_launch_at(0.0, min_step_s=took / 2) == at
    assert engine.next_launch_at(0.0, min_step_s=took * 2) is None   # a short step: no window
    while engine.has_work():
        engine.step()
    assert engine.next_launch_at(0.0) is None   # nothing in flight
    engine.scheduler.check_integrity()


def test_not_pipelined_schedules_at_once(warm_tiny) -> None:
    engine = new_tiny_engine(warm_tiny, pipelined=False)
    engine.add(request("a", list(range(1000, 1020)), max_tokens=4, ignore_eos=True))
    while engine.has_work():
        engine.step()
        assert engine.next_launch_at(0.0) is None
