"""The one rule: exact chunk sequences, decode-first ordering, block tables and slots."""

from __future__ import annotations

from collections.abc import Callable

from tests.serving.scheduler.scheduler_helpers import req, rows, step

from xlaserve.serving.scheduler import PENDING_TOKEN, Scheduler
from xlaserve.serving.types import Tier


def test_chunked_prefill_exact_sequence(make: Callable[..., Scheduler]) -> None:
    s = make(max_num_batched_tokens=8, max_prefill_chunk=6)
    s.add(req("A", 14))
    s.add(req("B", 5))
    p = step(s)
    assert rows(p) == [("A", 0, 6, False), ("B", 0, 2, False)]
    assert p.decodes == () and p.num_tokens == 8
    assert [r.block_table for r in p.rows] == [(1, 2), (3,)]
    p = step(s)
    assert rows(p) == [("A", 6, 6, False), ("B", 2, 2, False)]
    p = step(s)                                   # B has one token left: it is a decode now
    assert [(r.request_id, r.num_tokens) for r in p.decodes] == [("B", 1)]
    assert rows(p) == [("B", 4, 1, True), ("A", 12, 2, True)]
    assert p.decodes[0].block_table == (3, 5) and p.prefills[0].block_table == (1, 2, 4, 6)
    p = step(s)
    assert rows(p) == [("A", 14, 1, True), ("B", 5, 1, True)]
    a = p.decodes[0]
    assert a.token_ids == (1000 + 140 + sum(map(ord, "A")) % 10,)
    assert a.slot_mapping == (6 * 4 + 2,)         # position 14: block index 3 = block 6, slot 2
    assert p.prefills == ()


def test_slot_mapping_and_positions(make: Callable[..., Scheduler]) -> None:
    s = make(max_prefill_chunk=3)
    s.add(req("A", list(range(100, 107))))
    p = step(s)
    assert p.prefills[0].token_ids == (100, 101, 102)
    assert p.prefills[0].slot_mapping == (4, 5, 6)
    p = step(s)
    assert p.prefills[0].slot_mapping == (7, 8, 9)        # crosses into block 2
    assert p.prefills[0].block_table == (1, 2) and p.prefills[0].end_position == 6
    p = step(s)
    assert rows(p) == [("A", 6, 1, True)]                 # the last prompt token samples
    assert s.request_state("A").output_token_ids == (1070 + sum(map(ord, "A")) % 10,)


def test_decodes_first_even_before_higher_priority_chunks(make: Callable[..., Scheduler]) -> None:
    s = make(max_num_batched_tokens=4, max_prefill_chunk=4, max_num_seqs=4)
    s.add(req("low", 3))
    assert rows(step(s)) == [("low", 0, 3, True)]
    s.add(req("paid", 20, tier=Tier.PAID, arrival=1.0))
    assert rows(step(s)) == [("low", 3, 1, True), ("paid", 0, 3, False)]
    assert rows(step(s)) == [("low", 4, 1, True), ("paid", 3, 3, False)]


def test_max_tokens_stops_scheduling_and_reports_length(make: Callable[..., Scheduler]) -> None:
    s = make()
    s.add(req("A", 4, max_tokens=2))
    p = s.schedule(0.0)
    s.update(p, {"A": 5})
    assert s.length_finish_reason("A") is None
    p = s.schedule(0.0)
    s.update(p, {"A": 6})
    assert s.length_finish_reason("A") == "length"
    assert s.schedule(0.0).is_empty                        # not scheduled past max_tokens
    state = s.finish("A", "length")
    assert state.output_token_ids == (5, 6) and state.status == "length"
    assert s.stats().kv_cache.num_used_blocks == 0


def test_max_model_len_caps_output(make: Callable[..., Scheduler]) -> None:
    s = make(max_model_len=6)
    s.add(req("A", 4, max_tokens=100))
    step(s)                                                # samples position 4
    step(s)                                                # samples position 5: finished
    assert "A" not in s
    assert s.stats().num_finished == 1


def test_pending_token_is_only_ever_a_decode_input(make: Callable[..., Scheduler]) -> None:
    s = make(max_prefill_chunk=2)
    s.add(req("A", 3))
    s.schedule(0.0)
    p = s.schedule(0.0)                                    # before any update
    assert rows(p) == [("A", 2, 1, True)]
    p2 = s.schedule(0.0)
    assert p2.decodes[0].token_ids == (PENDING_TOKEN,)
    s.check_integrity()
