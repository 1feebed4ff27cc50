"""Verify rows: draft tokens planned within the step's limits, accepted ones kept, rejected
ones' KV slots given back (integrity after every step), never in the prefix cache."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.serving.scheduler.scheduler_helpers import req
from xlaserve.serving.scheduler import Scheduler, SchedulerConfig
from xlaserve.serving.speculative import SpeculativeConfig
from xlaserve.serving.types import SamplingParams

PROMPT = [10, 11, 12, 13, 14, 10, 11]   # its tail (10, 11) occurred at 0: drafts 12, 13, 14
OTHER = [20, 21, 22, 23, 24, 20, 21]    # the same shape, no shared prefix


def make(k: int = 3, **overrides: object) -> Scheduler:
    base: dict[str, object] = {"num_kv_blocks": 17, "block_size": 4, "max_num_seqs": 8,
                               "max_num_batched_tokens": 64, "max_prefill_chunk": 64,
                               "max_model_len": 64, "aging_seconds": float("inf")}
    base.update(overrides)
    return Scheduler(SchedulerConfig(**base),  # type: ignore[arg-type]
                     SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1,
                                       prompt_lookup_max=3))


def prefill(s: Scheduler, rid: str, first: int) -> None:
    plan = s.schedule(0.0)
    assert plan.rows[0].request_id == rid and plan.rows[0].num_draft == 0
    assert s.update(plan, {rid: first}) == {rid: (first,)}
    s.check_integrity()


def test_verify_row_keeps_accepted_drafts_and_trims_the_rest() -> None:
    s = make()
    s.add(req("A", PROMPT, max_tokens=20))
    prefill(s, "A", 12)                          # all = PROMPT + [12]: tail (10, 11, 12)
    plan = s.schedule(0.0)
    (row,) = plan.rows
    assert (row.token_ids, row.start_position, row.num_draft) == ((12, 13, 14, 10), 7, 3)
    assert row.sample_position == 8 and row.num_samples == 4 and plan.num_samples == 4
    assert len(row.slot_mapping) == 4 and len(row.block_table) == 3   # slots 7 .. 10
    s.check_integrity()
    used = s.kv_cache.usage().num_used_blocks
    # the target agrees with 13, not with 14: keeps 13 and its own 50
    assert s.update(plan, {"A": (13, 50, 7, 7)}) == {"A": (13, 50)}
    s.check_integrity()
    seq = s._seqs["A"]
    assert seq.all_token_ids == PROMPT + [12, 13, 50]
    assert seq.num_computed_tokens == 9 and s.kv_cache.num_tokens("A") == 9
    assert s.kv_cache.usage().num_used_blocks == used     # 9 slots still need 3 blocks
    assert (seq.num_draft_tokens, seq.num_accepted_tokens) == (3, 1)


def test_rejected_drafts_free_their_blocks_and_stay_out_of_the_prefix_cache() -> None:
    s = make()
    s.add(req("A", PROMPT, max_tokens=20))
    prefill(s, "A", 12)
    plan = s.schedule(0.0)
    assert plan.rows[0].num_draft == 3 and s.kv_cache.usage().num_used_blocks == 3
    assert s.update(plan, {"A": (99, 1, 2, 3)}) == {"A": (99,)}   # nothing accepted
    s.check_integrity()
    assert s.kv_cache.num_tokens("A") == 8 and s.kv_cache.usage().num_used_blocks == 2
    # the drafts' tokens (13, 14, 10 at 8 .. 10) were never registered: a prompt that
    # continues with them hits only the first block, the one of real tokens
    s.schedule(0.0)                                # registers A's computed full blocks
    probe = s.kv_cache.find_cached_prefix(PROMPT + [12, 13, 14, 10, 0], "")
    assert probe.num_tokens == 8                   # blocks 0..3 and 4..7, both real
    real = s.kv_cache.find_cached_prefix(PROMPT + [12, 99, 0, 0, 0], "")
    assert real.num_tokens == 8


def test_abort_mid_verification_frees_every_block() -> None:
    s = make()
    s.add(req("A", PROMPT, max_tokens=20))
    s.add(req("B", [40, 41, 42, 40, 41], max_tokens=20))
    plan = s.schedule(0.0)
    s.update(plan, {"A": 12, "B": 42})
    plan = s.schedule(0.0)
    assert {r.request_id: r.num_draft for r in plan.rows} == {"A": 3, "B": 3}
    s.abort("A")
    s.check_integrity()
    assert s.update(plan, {"A": (13, 14, 10, 11), "B": (40, 41, 0, 0)}) == {"B": (40, 41, 0)}
    s.check_integrity()
    s.abort("B")
    s.check_integrity()
    usage = s.kv_cache.usage()
    assert usage.num_used_blocks == 0
    assert usage.num_free_blocks + usage.num_cached_free_blocks == usage.num_total_blocks


def test_drafts_stay_within_max_tokens_rows_and_budget() -> None:
    s = make(k=4)
    s.add(req("A", PROMPT, max_tokens=3))          # 1 emitted, 2 to go: at most 1 draft
    prefill(s, "A", 12)
    assert s.schedule(0.0).rows[0].num_draft == 1

    s = make(k=4, max_num_seqs=3)                  # 2 rows: 1 spare sample row in all
    s.add(req("A", PROMPT, max_tokens=20))
    s.add(req("B", OTHER, max_tokens=20, arrival=1.0))
    plan = s.schedule(0.0)
    s.update(plan, {"A": 12, "B": 22})
    plan = s.schedule(0.0)
    # A (first by arrival) takes the spare row; a verify row is not a one-token decode
    assert {r.request_id: r.num_draft for r in plan.rows} == {"A": 1, "B": 0}
    assert plan.num_samples == 3 and plan.rows[-1].request_id == "A"
    s.update(plan, {"A": (13, 14), "B": 23})
    s.check_integrity()

    s = make(k=4, max_num_batched_tokens=8, max_num_seqs=4)   # 1 decode + budget 7 left
    s.add(req("A", PROMPT, max_tokens=20))
    prefill(s, "A", 12)
    s.add(req("C", list(range(200, 206)), max_tokens=20))     # its 6 prompt tokens first
    plan = s.schedule(0.0)
    assert {r.request_id: (r.num_tokens, r.num_draft) for r in plan.rows} == {
        "A": (2, 1), "C": (6, 0)}


def test_opt_out_and_penalties_never_speculate() -> None:
    s = make()
    s.add(replace(req("A", PROMPT, max_tokens=20), speculative=False))
    s.add(replace(req("B", OTHER, max_tokens=20),
                  sampling=SamplingParams(max_tokens=20, presence_penalty=0.5)))
    plan = s.schedule(0.0)
    s.update(plan, {"A": 12, "B": 22})
    plan = s.schedule(0.0)
    assert [r.num_draft for r in plan.rows] == [0, 0]


def test_update_checks_a_verify_rows_sample_count() -> None:
    s = make()
    s.add(req("A", PROMPT, max_tokens=20))
    prefill(s, "A", 12)
    plan = s.schedule(0.0)
    with pytest.raises(ValueError, match=r"wrong count \{'A': 1\}"):
        s.update(plan, {"A": 13})
    s.update(plan, {"A": (13, 14, 10, 11)})       # all accepted + the bonus token
    seq = s._seqs["A"]
    assert seq.all_token_ids == PROMPT + [12, 13, 14, 10, 11]
    assert seq.num_computed_tokens == 11 and seq.num_remaining == 1
    s.check_integrity()
