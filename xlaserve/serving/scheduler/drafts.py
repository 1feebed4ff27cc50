"""Verify rows: how the scheduler gives decode rows draft tokens and settles them afterwards.

Once a step's rows are chosen, each decode row of a request that speculates and has no
placeholder may take draft tokens from the proposer, up to k and what the budget, the sample
rows of the largest bucket (max_num_seqs in all: a verify row takes 1 + k) and its max_tokens /
max_model_len leave; it never preempts for them.  It becomes a verify row [t, d1 .. dk] whose
KV slots are reserved (Sequence.num_draft_slots) but whose drafts never enter all_token_ids.
`Scheduler.update` takes its k + 1 samples, keeps the accepted ones
(speculative/acceptance.py), and `settle_drafts` moves num_computed_tokens past the accepted
drafts and trims the KV reservation back to it: rejected drafts hold no slot and never reach
the prefix cache (only computed, known tokens are registered).  The engine reads a speculating
request's tokens back before scheduling it again (the proposal needs its last token), so a
verify row never meets a placeholder; a sequence with draft slots is not scheduled again
before its update.

    all:  [p p p t P]      row (t, d1, d2), slots for 3      samples (d1, x, y): a = 1
    after update: [p p p t d1 x]   num_computed = 5 (t, d1)   KV trimmed from 6 to 5 slots
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from xlaserve.serving.kv_cache import KVCacheManager
from xlaserve.serving.scheduler.config import SchedulerConfig
from xlaserve.serving.scheduler.sequence import Sequence, SequenceStatus
from xlaserve.serving.scheduler.step_plan import ScheduledSeq
from xlaserve.serving.speculative import NgramProposer, SpecStats


def propose_drafts(proposer: NgramProposer, kv_cache: KVCacheManager, config: SchedulerConfig,
                   entries: Seq[tuple[Sequence, int]], budget: int) -> dict[str, tuple[int, ...]]:
    """Draft tokens for the decode rows among `entries` (the step's (sequence, tokens) rows,
    in scheduling order) from what the step left: `budget` tokens, max_num_seqs sample rows,
    and KV slots (reserved here for the drafts returned)."""
    spare_rows = config.max_num_seqs - len(entries)
    out: dict[str, tuple[int, ...]] = {}
    for seq, n in entries:
        if spare_rows < 1 or budget < 1:
            break
        if n != 1 or seq.num_remaining != 1 or seq.num_pending or not seq.speculates:
            continue
        # the row emits 1 + k tokens at most: within max_tokens and max_model_len
        room = min(seq.request.sampling.max_tokens - seq.num_output_tokens,
                   config.max_model_len - seq.num_tokens) - 1
        limit = min(room, spare_rows, budget)
        if limit < 1:
            continue
        tokens = proposer.propose(seq.all_token_ids, limit)
        if not tokens or not kv_cache.allocate_slots(seq.request_id, len(tokens)):
            continue
        seq.num_draft_slots = len(tokens)
        out[seq.request_id] = tokens
        budget -= len(tokens)
        spare_rows -= len(tokens)
    return out


def settle_drafts(seq: Sequence, row: ScheduledSeq, kept: tuple[int, ...],
                  kv_cache: KVCacheManager, stats: SpecStats) -> None:
    """A verify row's samples came and `kept` (its accepted drafts, then the target's token)
    were chosen: the accepted drafts join the sequence as computed tokens, the target's token
    after them (already written at the row's sample position) is its next input, and the
    KV slots of the rejected drafts are given back."""
    accepted = len(kept) - 1
    seq.all_token_ids.extend(kept[1:])
    seq.num_draft_tokens += row.num_draft
    seq.num_accepted_tokens += accepted
    stats.observe(row.num_draft, accepted)
    if seq.status is SequenceStatus.RUNNING:   # else preempted since: recomputed later
        seq.num_computed_tokens += accepted
        seq.num_draft_slots = 0
        kv_cache.trim(seq.request_id, seq.num_computed_tokens)
