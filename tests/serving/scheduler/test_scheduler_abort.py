"""abort() in every phase frees every block; finish() and abort() bookkeeping."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.serving.scheduler.scheduler_helpers import req, rows, samples, step
from xlaserve.serving.scheduler import Scheduler


def assert_all_free(s: Scheduler) -> None:
    usage = s.stats().kv_cache
    assert usage.num_used_blocks == 0
    assert usage.num_free_blocks + usage.num_cached_free_blocks == usage.num_total_blocks
    s.check_integrity()


def test_abort_waiting(make: Callable[..., Scheduler]) -> None:
    s = make()
    s.add(req("A", 5))
    state = s.abort("A")
    assert state is not None and state.status == "abort" and state.output_token_ids == ()
    assert s.abort("A") is None and s.abort("never") is None
    assert s.schedule(0.0).is_empty
    assert_all_free(s)


def test_abort_mid_prefill(make: Callable[..., Scheduler]) -> None:
    s = make(max_prefill_chunk=4)
    s.add(req("A", 10))
    assert rows(step(s)) == [("A", 0, 4, False)]
    assert s.stats().kv_cache.num_used_blocks == 1
    s.abort("A")
    assert_all_free(s)


def test_abort_mid_decode_keeps_full_blocks_cached(make: Callable[..., Scheduler]) -> None:
    s = make()
    s.add(req("A", 9))
    step(s)
    step(s)
    s.abort("A")
    assert_all_free(s)
    assert s.kv_cache.pool.eviction_order() == (2, 1)   # the two full blocks, tail first


def test_abort_preempted(make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=5)
    s.add(req("A", 7, max_tokens=4))
    s.add(req("B", 7, max_tokens=4, arrival=1.0))
    step(s)
    step(s)
    assert step(s).preempted == ("B",)
    s.abort("B")
    s.abort("A")
    assert_all_free(s)


def test_abort_with_rows_in_flight(make: Callable[..., Scheduler]) -> None:
    s = make()
    s.add(req("A", 5))
    s.add(req("B", 5))
    p0 = s.schedule(0.0)
    p1 = s.schedule(0.0)                 # one step ahead: both rows in flight twice
    s.abort("A")
    assert s.update(p0, samples(p0)) == {"B": (samples(p0)["B"],)}
    assert s.update(p1, samples(p1)) == {"B": (samples(p1)["B"],)}
    s.abort("B")
    assert_all_free(s)


def test_finish_rejects_unknown_reason_and_request(make: Callable[..., Scheduler]) -> None:
    s = make()
    s.add(req("A", 3))
    with pytest.raises(ValueError, match="finish reason 'done'"):
        s.finish("A", "done")
    with pytest.raises(ValueError, match="unknown request 'X'"):
        s.finish("X", "stop")
    assert s.finish("A", "error").status == "error"
    assert s.stats().num_finished == 1
    assert_all_free(s)
