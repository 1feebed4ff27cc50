"""Verify rows from a draft model (a BatchProposer): every candidate row's slots reserved
before the one batch proposal, the draft's progress advanced by each proposal, cut back to the
accepted prefix by each verification and forgotten on preemption and finish; integrity of
the pool and of the progress after every step."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tests.serving.scheduler.scheduler_helpers import req
from xlaserve.serving.scheduler import Scheduler, SchedulerConfig
from xlaserve.serving.speculative import DraftQuery, SpeculativeConfig

SPEC = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_layers=1)


class CountingDraft:
    """Proposes last token + 1, + 2, ...; records every batch it was asked."""

    def __init__(self) -> None:
        self.batches: list[list[DraftQuery]] = []

    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[tuple[int, ...]]:
        self.batches.append(list(queries))
        return [tuple(q.token_ids[-1] + 1 + j for j in range(q.limit)) for q in queries]


def make(draft: CountingDraft, **overrides: object) -> Scheduler:
    base: dict[str, object] = {"num_kv_blocks": 17, "block_size": 4, "max_num_seqs": 8,
                               "max_num_batched_tokens": 64, "max_prefill_chunk": 64,
                               "max_model_len": 64, "aging_seconds": float("inf")}
    base.update(overrides)
    return Scheduler(SchedulerConfig(**base), SPEC, draft)  # type: ignore[arg-type]


def test_method_draft_needs_its_proposer_and_only_it() -> None:
    cfg = SchedulerConfig(num_kv_blocks=17, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="draft_model=None goes with method 'draft'"):
        Scheduler(cfg, SPEC)
    with pytest.raises(ValueError, match="goes with method 'draft'"):
        Scheduler(cfg, SpeculativeConfig(), CountingDraft())


def test_proposal_reserves_slots_advances_progress_and_settles_to_the_accepted() -> None:
    draft = CountingDraft()
    s = make(draft)
    progress = s.draft_progress
    assert progress is not None
    s.add(req("A", [1, 2, 3, 4, 5, 6, 7], max_tokens=20))
    s.add(req("B", [9, 8, 7, 6, 5], max_tokens=3))
    plan = s.schedule(0.0)                    # prefills: no drafts
    assert not draft.batches and all(r.num_draft == 0 for r in plan.rows)
    s.update(plan, {"A": 40, "B": 60})
    s.check_integrity()

    plan = s.schedule(0.0)
    (batch,) = draft.batches
    # A: all 7 prompt tokens + 40 known, the draft has computed nothing yet; B: max_tokens
    # leaves room for 1 draft (it has 1 output token, emits at most 2 more)
    assert [(q.request_id, q.start, q.limit, q.token_ids[-1]) for q in batch] == [
        ("A", 0, 3, 40), ("B", 0, 1, 60)]
    a = next(r for r in plan.rows if r.request_id == "A")
    assert (a.token_ids, a.start_position, a.num_draft) == ((40, 41, 42, 43), 7, 3)
    assert s.kv_cache.num_tokens("A") == 11                  # 7 computed + t + 3 drafts
    assert progress.computed("A") == 8 + 3 - 1               # t, d1, d2 written by the draft
    s.check_integrity()

    # A keeps 41, rejects 42 (the target said 77); B takes its draft and its bonus
    s.update(plan, {"A": (41, 77, 0, 0), "B": (61, 62)})
    s.check_integrity()
    assert s.kv_cache.num_tokens("A") == 9 and progress.computed("A") == 9
    assert s._seqs["A"].all_token_ids[-3:] == [40, 41, 77]

    plan = s.schedule(0.0)
    q = draft.batches[-1][0]
    assert (q.request_id, q.start, q.token_ids[-1]) == ("A", 9, 77)   # feeds 77 only
    s.finish("B", "length")
    s.update(plan, {"A": (78, 79, 80, 81)})                # all accepted, 81 the bonus
    s.check_integrity()
    assert s.kv_cache.num_tokens("A") == 13
    # the draft wrote through d2 (position 11); d3 (= 80, position 12) it never saw
    assert progress.computed("A") == 12
    plan = s.schedule(0.0)
    assert draft.batches[-1][0].start == 12                # feeds 80 and 81
    s.finish("A", "abort")
    assert progress.computed("A") == 0
    s.check_integrity()
    assert s.kv_cache.usage().num_used_blocks == 0


def test_preemption_forgets_the_draft_cache() -> None:
    draft = CountingDraft()
    s = make(draft, num_kv_blocks=7, max_num_seqs=2)       # 6 usable blocks of 4 tokens
    s.add(req("A", list(range(1, 10)), max_tokens=12))
    plan = s.schedule(0.0)
    s.update(plan, {"A": 50})
    plan = s.schedule(0.0)
    assert plan.rows[0].num_draft > 0
    s.update(plan, {"A": tuple(range(51, 51 + plan.rows[0].num_samples))})
    assert s.draft_progress is not None and s.draft_progress.computed("A") > 0
    s.check_integrity()
    s._preempt(s._seqs["A"])                                # what running out of blocks does
    assert s.draft_progress.computed("A") == 0
    s.check_integrity()
    plan = s.schedule(0.0)          # recomputed (past its own cached blocks), no drafts
    assert plan.rows[0].start_position == 8 and plan.rows[0].num_draft == 0
    s.update(plan, {"A": 60})
    s.check_integrity()
    s.schedule(0.0)
    # the draft's KV went with the blocks: its next proposal feeds the draft from 0
    assert draft.batches[-1][0].start == 0 and draft.batches[-1][0].token_ids[-1] == 60
    s.check_integrity()
