"""Verify rows: how the scheduler gives decode rows draft tokens and settles them afterwards.

Once a step's rows are chosen, each decode row of a request that speculates and has no
placeholder may take draft tokens from the proposer, up to k and what the budget, the sample
rows of the largest bucket (max_num_seqs in all: a verify row takes 1 + k) and its max_tokens /
max_model_len leave; it never preempts for them.  It becomes a verify row [t, d1 .. dk] whose
KV slots are reserved (Sequence.num_reserved_drafts) but whose drafts never enter all_token_ids.
`Scheduler.update` takes its k + 1 samples, keeps the accepted ones
(speculative/acceptance.py), and `settle_drafts` moves num_computed_tokens past the accepted
drafts and trims the KV reservation back to it: rejected drafts hold no slot and never reach
the prefix cache (only computed, known tokens are registered).  The engine reads a speculating
request's tokens back before scheduling it again (the proposal needs its last token), so a
verify row never meets a placeholder; a sequence with drafts reserved is not scheduled again
before its update.

    all:  [p p p t P]      row (t, d1, d2), slots for 3      samples (d1, x, y): a = 1
    after update: [p p p t d1 x]   num_computed = 5 (t, d1)   KV trimmed from 6 to 5 slots

A draft model (`BatchProposer`) is asked once for all the step's candidate rows: each row's
slots for `limit` drafts are reserved first (the draft writes its own KV at them), then the
proposer returns exactly `limit` tokens per row; `DraftProgress` records how far the draft's
cache followed, and settle_drafts cuts it back to the accepted prefix.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from xlaserve.serving.kv_cache import KVCacheManager
from xlaserve.serving.scheduler.config import SchedulerConfig
from xlaserve.serving.scheduler.sequence import Sequence, SequenceStatus
from xlaserve.serving.scheduler.step_plan import ScheduledSeq
from xlaserve.serving.speculative import (
    BatchProposer,
    DraftProgress,
    DraftQuery,
    NgramProposer,
    SpecStats,
)


def _draft_room(seq: Sequence, n: int, config: SchedulerConfig) -> int:
    """Drafts row (`seq`, n tokens) may take: 0 unless it is a speculating decode row with its
    last token known; else what max_tokens / max_model_len leave (the row emits 1 + k)."""
    if n != 1 or seq.num_remaining != 1 or seq.num_pending or not seq.speculates:
        return 0
    return min(seq.request.sampling.max_tokens - seq.num_output_tokens,
               config.max_model_len - seq.num_tokens) - 1


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
        limit = min(_draft_room(seq, n, config), spare_rows, budget)
        if limit < 1:
            continue
        tokens = proposer.propose(seq.all_token_ids, limit)
        if not tokens or not kv_cache.allocate_slots(seq.request_id, len(tokens)):
            continue
        seq.num_reserved_drafts = len(tokens)
        out[seq.request_id] = tokens
        budget -= len(tokens)
        spare_rows -= len(tokens)
    return out


def propose_model_drafts(proposer: BatchProposer, k: int, progress: DraftProgress,
                         kv_cache: KVCacheManager, config: SchedulerConfig,
                         entries: Seq[tuple[Sequence, int]], budget: int
                         ) -> dict[str, tuple[int, ...]]:
    """As propose_drafts, for a draft model: every candidate row (up to `k` drafts each, in
    scheduling order, while the budget and sample rows last) reserves KV slots for its drafts, then
    one batch proposal fills them all."""
    spare_rows = config.max_num_seqs - len(entries)
    chosen: list[tuple[Sequence, DraftQuery]] = []
    for seq, n in entries:
        limit = min(_draft_room(seq, n, config), k, spare_rows, budget)
        if limit < 1 or not kv_cache.allocate_slots(seq.request_id, limit):
            continue
        start = progress.start(seq.request_id, seq.num_computed_tokens)
        chosen.append((seq, DraftQuery(seq.request_id, tuple(seq.all_token_ids), start,
                                       kv_cache.block_table(seq.request_id), limit,
                                       seq.request.sampling, seq.num_prompt_tokens)))
        budget -= limit
        spare_rows -= limit
    if not chosen:
        return {}
    try:
        drafted = proposer.propose_batch([q for _, q in chosen])
    except BaseException:   # a failed draft call: give the reservations back, then fail
        for seq, _ in chosen:
            kv_cache.trim(seq.request_id, seq.num_computed_tokens + 1)
        raise
    out: dict[str, tuple[int, ...]] = {}
    for (seq, query), tokens in zip(chosen, drafted, strict=True):
        if len(tokens) != query.limit:
            raise ValueError(f"{query.request_id}: the draft proposer returned {len(tokens)} "
                             f"tokens for a limit of {query.limit}")
        progress.proposed(query)
        seq.num_reserved_drafts = query.limit
        out[seq.request_id] = tuple(tokens)
    return out


def settle_drafts(seq: Sequence, row: ScheduledSeq, kept: tuple[int, ...],
                  kv_cache: KVCacheManager, stats: SpecStats,
                  progress: DraftProgress | None = None) -> None:
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
        seq.num_reserved_drafts = 0
        kv_cache.trim(seq.request_id, seq.num_computed_tokens)
        if progress is not None:
            progress.settle(seq.request_id, seq.num_computed_tokens)
