"""The work-based wait projection, by hand: slots, service times, prefill stalls."""

from __future__ import annotations

import pytest

from xlaserve.serving.admission import Rates, Work, queue_wait

# 2 slots; a step every 0.1 s; 100 prompt tokens per second: Work(100, 10) holds a slot
# 1.0 + 1.0 = 2 s, of which 1 s is prefill (stalling everyone).
RATES = Rates(lanes=2, step_s=0.1, prefill_tokens_per_s=100.0)
W = Work(prompt_tokens=100, max_tokens=10)


def test_free_slots_start_at_once():
    assert RATES.service_s(W) == pytest.approx(2.0)
    assert queue_wait(RATES, [], []) == 0.0
    assert queue_wait(RATES, [(W, 0.0)], []) == 0.0         # one of two slots free


def test_running_requests_free_their_slots_after_their_remaining_service():
    # both slots busy, started 0.5 s and 1.5 s ago: the second frees in 0.5 s
    assert queue_wait(RATES, [(W, 0.5), (W, 1.5)], []) == pytest.approx(0.5)
    # overdue (longer than projected): it may end at the next step, not in the past
    assert queue_wait(RATES, [(W, 0.5), (W, 9.0)], []) == pytest.approx(0.1)


def test_queued_work_ahead_takes_the_earliest_slots_and_stalls_everyone():
    running = [(W, 0.5), (W, 1.5)]                  # slots free at 1.5 and 0.5
    # one ahead: takes the slot at 0.5 (busy until 2.5); the newcomer gets the one at 1.5,
    # after the one ahead's 1 s of prefill
    assert queue_wait(RATES, running, [W]) == pytest.approx(1.5 + 1.0)
    # a short request ahead costs less than a long one: work, not request count.  It takes
    # the slot at 0.5 for 0.2 s and hands it to the newcomer at 0.7, after 0.1 s of prefill
    short = Work(prompt_tokens=10, max_tokens=1)
    assert queue_wait(RATES, running, [short]) == pytest.approx(0.5 + 0.2 + 0.1)
    # beyond `slots`, running requests wait in the engine's queue: they count as ahead
    assert queue_wait(RATES, [*running, (W, 0.0)], []) == queue_wait(RATES, running, [W])


def test_weight_waits_for_all_of_its_slots():
    running = [(W, 0.5), (W, 1.5)]
    assert queue_wait(RATES, running, [], weight=2) == pytest.approx(1.5)
    assert queue_wait(RATES, running, [], weight=5) == pytest.approx(1.5)  # at most all slots
