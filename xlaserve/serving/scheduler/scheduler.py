"""Iteration-level scheduling under a token budget, with one rule for every row.

Each step, every scheduled sequence gets

    n = min(max_prefill_chunk, budget_left, len(all_token_ids) - num_computed_tokens)

tokens, starting at position num_computed_tokens; when the step brings num_computed_tokens to
len(all_token_ids), the row samples. A decode is the case of one remaining token; a chunked
prefill is the case of many; a prefix hit starts num_computed_tokens at the hit length; a
preempted request restarts at 0 with its generated tokens recomputed as prompt (it samples only
past them, so nothing is emitted twice). Order within a step:

    1. running sequences with one token left (decodes), in priority order
    2. running sequences with more left (prefill chunks), in priority order
    3. waiting sequences, in priority order, while max_num_seqs, the budget and the KV pool allow
       (skipped in a step that had to preempt; stops at the first that does not fit). One whose
       first uncached full block a running request is about to compute waits for it instead of
       computing it again: n > 1 completions of one prompt, or many requests arriving together
       with one system prompt, compute the shared prefix once and then hit it.

A running prefill chunk that does not fit shrinks to the blocks the pool has left; a running
sequence that cannot get even one token's block preempts the lowest-priority, latest running
sequence (possibly itself) until it fits: blocks freed, num_computed_tokens = 0, back to
waiting ahead of its equal-priority peers. `add` rejects a request that could not fit the pool
even alone.

Pipelining. `schedule()` may run again before the previous plan's samples are known. A row that
samples appends PENDING_TOKEN to its sequence at once, so the next step schedules it as a
one-token decode whose input is the placeholder; the runner substitutes the token sampled on
device. `update(plan, sampled)` later overwrites the placeholder; plans are updated in order.

    host    schedule(0)  schedule(1)  update(0)  schedule(2)  update(1)  ...
    device       |--- step 0 ---|--- step 1 ---|--- step 2 ---|
    S.all   [p p p P]    [p p p P P]  [p p p 42 P]  [p p p 42 P P]  [p p p 42 7 P]
    S row   (prefill)    token_ids=(P,), start_position=3 (P = 42, fed on device)

Alternating schedule(n), update(n), schedule(n+1) never feeds a placeholder. If the engine ends
S after update(0) (eos, stop string) while step 1 already holds S's row, finish() frees S's
blocks at once: step 1's extra row still writes into them on device, but only plans built later
can reuse them and the device runs those later; update(1) then drops S's sample. A preempted
sequence with a placeholder is not re-admitted until update() fills it in. When a step fails,
its samples never come: the engine ends the running requests and `drop_in_flight()` forgets
every plan not yet updated.

Speculative decoding (with a `SpeculativeConfig`): once a step's rows are chosen, decode rows
may become verify rows of 1 + k tokens; `update` keeps the accepted drafts and trims the KV of
the rest (drafts.py has the protocol).  With method "draft" the engine hands in the draft model
(a BatchProposer) and the scheduler tracks its cache (`draft_progress`).

Prefix-cache hits are registered between steps (start of `schedule`, preemption, finish), so a
hit always reads KV that an earlier device step wrote.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as Sequence_

from xlaserve.models.kv_slots import slot_mapping
from xlaserve.serving.kv_cache import KVCacheManager
from xlaserve.serving.scheduler.config import SchedulerConfig
from xlaserve.serving.scheduler.drafts import (
    propose_drafts,
    propose_model_drafts,
    settle_drafts,
)
from xlaserve.serving.scheduler.priority import priority_key, waiting_key
from xlaserve.serving.scheduler.request_checks import check_request, check_samples
from xlaserve.serving.scheduler.scheduler_stats import SchedulerStats
from xlaserve.serving.scheduler.sequence import RequestState, Sequence, SequenceStatus
from xlaserve.serving.scheduler.step_builder import StepBuilder
from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN, ScheduledSeq, StepPlan
from xlaserve.serving.speculative import (
    BatchProposer,
    DraftProgress,
    NgramProposer,
    SpecStats,
    SpeculativeConfig,
)
from xlaserve.serving.speculative.acceptance import accept_drafts
from xlaserve.serving.types import GREEDY, GenerationRequest

FINISH_REASONS = ("stop", "length", "abort", "error")


class Scheduler:
    def __init__(self, config: SchedulerConfig, speculative: SpeculativeConfig | None = None,
                 draft_model: BatchProposer | None = None) -> None:
        """`draft_model`: the proposer of method "draft" (required with it, refused without)."""
        self.config = config
        self.speculative = speculative
        if (draft_model is not None) != (speculative is not None
                                         and speculative.method == "draft"):
            raise ValueError(f"draft_model={draft_model!r} goes with method 'draft', got "
                             f"speculative={speculative!r}")
        self.proposer: NgramProposer | BatchProposer | None = draft_model or (
            NgramProposer(speculative) if speculative is not None else None)
        self.draft_progress = DraftProgress() if draft_model is not None else None
        self.spec_stats = SpecStats()
        self.kv_cache = KVCacheManager(config.num_kv_blocks, config.block_size,
                                       enable_prefix_caching=config.enable_prefix_caching)
        self._seqs: dict[str, Sequence] = {}
        self._running: dict[str, Sequence] = {}
        self._waiting: dict[str, Sequence] = {}
        self._in_flight: deque[StepPlan] = deque()  # plans made, not yet updated, oldest first
        self._next_seq_no = 0
        self._num_steps = 0
        self._num_preemptions = 0
        self._num_finished = 0

    # ---- requests in and out --------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Queue a request; ValueError when it could never run."""
        rid = request.request_id
        if rid in self._seqs or any(r.request_id == rid for p in self._in_flight for r in p.rows):
            raise ValueError(f"request_id {rid!r} is already in use")
        check_request(request, self.config, self.kv_cache.blocks_needed)
        seq = Sequence.from_request(request, self._next_seq_no)
        self._next_seq_no += 1
        self._seqs[rid] = seq
        self._waiting[rid] = seq

    def finish(self, request_id: str, reason: str) -> RequestState:
        """End a request the engine decided is done; frees its blocks (hashed ones stay
        cached). A row of it in a plan not yet updated is dropped by `update`."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason {reason!r}: expected one of {FINISH_REASONS}")
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            raise ValueError(f"unknown request {request_id!r} (never added, or already ended)")
        if seq.status is SequenceStatus.RUNNING:
            self._cache_computed(seq)
            self.kv_cache.free(request_id)
            if self.draft_progress is not None:
                self.draft_progress.forget(request_id)
            del self._running[request_id]
        else:
            del self._waiting[request_id]
        self._num_finished += 1
        return RequestState.of(seq, reason)

    def abort(self, request_id: str) -> RequestState | None:
        """End a request in any phase; None when it is unknown or already ended."""
        return self.finish(request_id, "abort") if request_id in self._seqs else None

    def length_finish_reason(self, request_id: str) -> str | None:
        """"length" once the reported tokens reach max_tokens or max_model_len."""
        seq = self._get(request_id)
        done = seq.output_limit_reached(self.config.max_model_len, known_only=True)
        return "length" if done else None

    # ---- the step -------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        """Plan the next device step at time `now` (the clock the requests' times use)."""
        cfg = self.config
        for seq in self._running.values():
            self._cache_computed(seq)
        step = StepBuilder(cfg.max_num_batched_tokens)
        order = sorted(self._running.values(),
                       key=lambda s: priority_key(s, now, cfg.aging_seconds))
        decodes = [s for s in order if s.num_remaining == 1]
        chunks = [s for s in order if s.num_remaining > 1]
        for seq in decodes + chunks:
            if step.budget == 0:
                break
            if (seq.status is not SequenceStatus.RUNNING    # preempted earlier in this step
                    or seq.num_reserved_drafts                # a verify row not yet updated
                    or seq.output_limit_reached(cfg.max_model_len, known_only=False)):
                continue
            n = self._reserve_or_preempt(
                seq, min(cfg.max_prefill_chunk, step.budget, seq.num_remaining), step, now)
            if n:
                step.add(seq, n)
        if not step.preempted:
            self._admit(step, now)
        if self.proposer is not None:
            self._propose(step)
        return self._emit(step)

    def update(self, plan: StepPlan, sampled: Mapping[str, int | Sequence_[int]]
               ) -> dict[str, tuple[int, ...]]:
        """Fill in the tokens `plan` sampled (an int per sampling row, the k + 1 samples of a
        verify row); returns the tokens each request still alive gained (the ones to emit: one,
        or a verify row's accepted drafts and the target's token). Every non-empty plan is
        updated once, in the order they were made."""
        if plan.is_empty:
            if sampled:
                raise ValueError(f"step {plan.step_id} is empty, got samples for {list(sampled)}")
            return {}
        expected = self._in_flight[0].step_id if self._in_flight else None
        if plan.step_id != expected:
            raise ValueError(f"update for step {plan.step_id}, expected step {expected}: "
                             "update each non-empty plan once, in order")
        live = {r.request_id: r for r in plan.rows if r.sample and r.request_id in self._seqs}
        given = check_samples(plan, sampled, live)
        self._in_flight.popleft()
        out: dict[str, tuple[int, ...]] = {}
        for rid, row in live.items():
            seq = self._seqs[rid]
            assert seq.all_token_ids[row.sample_position] == PENDING_TOKEN, (rid, row)
            out[rid] = accept_drafts(row.draft_token_ids, given[rid])
            seq.all_token_ids[row.sample_position] = out[rid][0]
            if row.num_draft:
                settle_drafts(seq, row, out[rid], self.kv_cache, self.spec_stats,
                              self.draft_progress)
        return out

    @property
    def in_flight(self) -> tuple[StepPlan, ...]:
        """The non-empty plans made and not yet updated, oldest first: the engine's steps in
        flight (its one queue of them)."""
        return tuple(self._in_flight)

    def drop_in_flight(self) -> None:
        """Forget every plan not yet updated: its samples are lost (a failed device step).
        Waiting sequences lose their placeholders and will sample those positions again.
        The caller has ended every running request first (their KV is gone with the step);
        afterwards `check_integrity()` holds and `update` expects the next plan made."""
        if self._running:
            raise ValueError(f"drop_in_flight with running requests {sorted(self._running)}: "
                             "finish them first, their cache state is lost")
        self._in_flight.clear()
        for seq in self._seqs.values():
            del seq.all_token_ids[seq.num_known_tokens:]

    def _reserve_or_preempt(self, seq: Sequence, n: int, step: StepBuilder, now: float) -> int:
        """Reserve slots for up to n more tokens of running `seq` and return how many: a
        prefill chunk shrinks to the room the pool has; one with no room, or a decode,
        preempts the lowest-priority, latest running sequences until it fits (0 when `seq`
        itself was the victim)."""
        aging = self.config.aging_seconds
        while True:
            fit = min(n, self.kv_cache.room(seq.request_id))
            if fit and self.kv_cache.allocate_slots(seq.request_id, fit):
                return fit
            victim = max(self._running.values(), key=lambda s: priority_key(s, now, aging))
            self._preempt(victim)
            step.drop(victim)
            if victim is seq:
                return 0

    def _admit(self, step: StepBuilder, now: float) -> None:
        cfg = self.config
        in_flight: set[bytes] | None = None  # built on first need
        for seq in sorted(self._waiting.values(),
                          key=lambda s: waiting_key(s, now, cfg.aging_seconds)):
            if len(self._running) >= cfg.max_num_seqs or step.budget == 0:
                return
            if seq.num_pending or seq.output_limit_reached(cfg.max_model_len, known_only=False):
                continue  # waits for update() / for the engine to finish it
            prefix = self.kv_cache.find_cached_prefix(seq.all_token_ids, seq.request.tenant)
            if prefix.miss_hash is not None:
                if in_flight is None:   # the full blocks running requests have yet to register
                    in_flight = {h for s in self._running.values() for h in self._unregistered(s)}
                if prefix.miss_hash in in_flight:
                    continue  # a running request is computing that block: hit it later
            n = min(cfg.max_prefill_chunk, step.budget, seq.num_tokens - prefix.num_tokens)
            if not self.kv_cache.allocate_slots(seq.request_id, n, prefix,
                                                readmitted=seq.num_preemptions > 0):
                return  # strict priority: nobody jumps a request that does not fit
            seq.num_computed_tokens = prefix.num_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = prefix.num_tokens
            seq.status, seq.requeued = SequenceStatus.RUNNING, False
            del self._waiting[seq.request_id]
            self._running[seq.request_id] = seq
            step.add(seq, n)
            if in_flight is not None:
                in_flight.update(self._unregistered(seq))

    def _unregistered(self, seq: Sequence) -> list[bytes]:
        known = seq.all_token_ids[:seq.num_known_tokens]
        return self.kv_cache.unregistered_block_hashes(seq.request_id, known)

    def _propose(self, step: StepBuilder) -> None:
        assert self.proposer is not None and self.speculative is not None
        entries = list(step.entries.values())
        if isinstance(self.proposer, NgramProposer):
            drafts = propose_drafts(self.proposer, self.kv_cache, self.config, entries,
                                    step.budget)
        else:
            assert self.draft_progress is not None
            drafts = propose_model_drafts(self.proposer, self.speculative.num_speculative_tokens,
                                          self.draft_progress, self.kv_cache, self.config,
                                          entries, step.budget)
        step.drafts.update(drafts)
        step.budget -= sum(len(d) for d in drafts.values())

    def _emit(self, step: StepBuilder) -> StepPlan:
        bs = self.config.block_size
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        for rid, (seq, n) in step.entries.items():
            start = seq.num_computed_tokens
            table = self.kv_cache.block_table(rid)
            sample = start + n == seq.num_tokens
            drafts = step.drafts.get(rid, ())
            m = n + len(drafts)
            row = ScheduledSeq(rid, tuple(seq.all_token_ids[start:start + n]) + drafts, start,
                               table, slot_mapping(table, start, m, bs), sample, len(drafts),
                               seq.request.sampling if sample else GREEDY,
                               start + n - seq.num_prompt_tokens if sample else 0)
            seq.num_computed_tokens += n
            if sample:
                seq.all_token_ids.append(PENDING_TOKEN)
            (decodes if m == 1 and sample else prefills).append(row)
        plan = StepPlan(self._num_steps, tuple(decodes), tuple(prefills), tuple(step.preempted))
        self._num_steps += 1
        if not plan.is_empty:
            self._in_flight.append(plan)
        return plan

    def _preempt(self, seq: Sequence) -> None:
        self._cache_computed(seq)  # so the recompute can hit its own full blocks
        self.kv_cache.free(seq.request_id)
        if self.draft_progress is not None:
            self.draft_progress.forget(seq.request_id)
        seq.num_computed_tokens = seq.num_reserved_drafts = 0
        seq.status, seq.requeued = SequenceStatus.WAITING, True
        seq.num_preemptions += 1
        self._num_preemptions += 1
        del self._running[seq.request_id]
        self._waiting[seq.request_id] = seq

    def _cache_computed(self, seq: Sequence) -> None:
        """Register the full blocks of tokens already scheduled and known (not placeholders)."""
        k = min(seq.num_computed_tokens, seq.num_known_tokens)
        self.kv_cache.cache_blocks(seq.request_id, seq.all_token_ids, k)

    # ---- reporting ------------------------------------------------------------------------

    def request_state(self, request_id: str) -> RequestState:
        return RequestState.of(self._get(request_id))

    def __contains__(self, request_id: str) -> bool:
        """True while the request is waiting or running (not yet finished or aborted)."""
        return request_id in self._seqs

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self._running), len(self._waiting), self._num_preemptions,
                              self._num_finished, self._num_steps, self.kv_cache.usage(),
                              self.kv_cache.prefix_cache_stats, self.spec_stats.snapshot())

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()
        assert not self._running.keys() & self._waiting.keys(), "running and waiting overlap"
        assert self._running.keys() | self._waiting.keys() == self._seqs.keys(), "lost a request"
        assert self.kv_cache.request_ids() == self._running.keys(), "blocks held by non-running"
        assert len(self._running) <= self.config.max_num_seqs, "too many running"
        if self.draft_progress is not None:
            self.draft_progress.check_integrity(
                {rid: self.kv_cache.num_tokens(rid) for rid in self._running})
        for rid, seq in self._seqs.items():
            known = seq.num_known_tokens
            assert PENDING_TOKEN not in seq.all_token_ids[:known], f"{rid}: placeholder inside"
            assert seq.num_pending <= len(self._in_flight), f"{rid}: placeholder never updated"
            if seq.status is SequenceStatus.RUNNING:
                assert rid in self._running
                assert 0 < seq.num_computed_tokens <= seq.num_tokens, rid
                assert (self.kv_cache.num_tokens(rid)
                        == seq.num_computed_tokens + seq.num_reserved_drafts), rid
            else:
                assert rid in self._waiting and seq.num_computed_tokens == 0, rid
                assert seq.num_reserved_drafts == 0, f"{rid}: waiting with drafts reserved"

    def _get(self, request_id: str) -> Sequence:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise ValueError(f"unknown request {request_id!r}") from None
