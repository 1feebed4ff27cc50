"""The draft model as a proposer (speculative method "draft"): k device calls of the draft
runner for all of a step's verify rows at once, launched back to back.

    queries (scheduler: rows, their tokens, where the draft's cache stands, slots reserved)
      catch-up   rows whose draft KV lags by more than 1 + k tokens (a new request, one
                 that decoded without drafts, a preempted one) feed it in chunks up to the
                 draft's token bucket, sampling nothing
      call 0     each row feeds the rest of its tokens (its last sampled token t, after an
                 accepted bonus token also the draft before it) and samples d1
      call j     each row with limit > j feeds d_j (PENDING_TOKEN: the draft runner's own
                 token cell, sampled by call j - 1 on device) and samples d_(j+1)
      fetch      the drafts, and for rows at temperature > 0 the distributions q they were
                 drawn from ([limit, V] per row, `probs`), which the verify row takes to the
                 target's sampler (runner/draft_verify.py: accept with min(1, p/q))

Draft j of a row is drawn with the row's own sampling parameters and token index (the
query's `sampling`, output index len(token_ids) - num_prompt_tokens + j), its seed salted
(DRAFT_SALT): independent of the target's draws, still batch-invariant; no penalties, no
logprobs.  Greedy rows' drafts are the draft's argmax, a point mass (no q).  Each query's
request id owns a token cell of the draft runner for the proposal (PENDING_TOKEN reads it),
given back when the proposal ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from xlaserve.serving.runner.calls import CallResult
from xlaserve.serving.runner.draft_runner import DraftRunner
from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN, ScheduledSeq
from xlaserve.serving.speculative import DraftQuery

DRAFT_SALT = 0x64726674   # "drft": the draft's seeds are the request's, xor this


class DraftProposer:
    def __init__(self, runner: DraftRunner, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.probs: dict[str, np.ndarray] = {}   # [limit, V] float32 per sampled row, last step
        self.num_calls = 0                       # draft runner calls made (catch-up included)

    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[tuple[int, ...]]:
        """Exactly `limit` draft tokens per query (scheduler/drafts.py: propose_model_drafts)."""
        if len(queries) > self.runner.max_num_seqs:
            raise ValueError(f"{len(queries)} draft rows exceed the draft runner's "
                             f"{self.runner.max_num_seqs}")
        bad = [q.request_id for q in queries if q.limit > self.k]
        if bad:
            raise ValueError(f"rows {bad} ask for more than k={self.k} drafts")
        self.probs = {}
        try:
            return self._propose(queries)
        finally:
            for q in queries:
                self.runner.cells.release(q.request_id)

    def _propose(self, queries: Sequence[DraftQuery]) -> list[tuple[int, ...]]:
        starts = self._catch_up(queries)
        calls: list[tuple[CallResult, object]] = []
        for j in range(max(q.limit for q in queries)):
            rows = [self._row(q, starts[i], j) for i, q in enumerate(queries) if q.limit > j]
            calls.append((self.runner.run(rows), self.runner.last_probs))
            self.num_calls += 1
        drafts: list[list[int]] = [[] for _ in queries]
        probs: list[list[np.ndarray]] = [[] for _ in queries]
        for j, (call, q_dev) in enumerate(calls):
            tokens = call.fetch()["tokens"]
            q_host = None if q_dev is None else np.asarray(q_dev)
            live = [i for i, q in enumerate(queries) if q.limit > j]
            for at, i in enumerate(live):
                drafts[i].append(int(tokens[at]))
                if q_host is not None:
                    probs[i].append(q_host[at])
        for i, q in enumerate(queries):
            if probs[i] and q.sampling.temperature > 0:
                self.probs[q.request_id] = np.stack(probs[i])       # [limit, V]
        return [tuple(d) for d in drafts]

    def _catch_up(self, queries: Sequence[DraftQuery]) -> list[int]:
        """Feed the draft every row's tokens up to the last 1 + k, in chunks; returns each
        row's new start."""
        starts = [q.start for q in queries]
        tail = 1 + self.k
        max_tokens = self.runner.buckets.max_tokens
        while True:
            rows, budget = [], max_tokens
            for i, q in enumerate(queries):
                n = min(len(q.token_ids) - tail - starts[i], budget)
                if n < 1:
                    continue
                rows.append(self.runner.row(q.request_id, q.token_ids[starts[i]:starts[i] + n],
                                            starts[i], q.block_table, sample=False))
                starts[i] += n
                budget -= n
                if budget < 1:
                    break
            if not rows:
                return starts
            self.runner.run(rows)
            self.num_calls += 1

    def _row(self, q: DraftQuery, start: int, j: int) -> ScheduledSeq:
        """Call j's row of query `q`: the rest of its tokens (j = 0) or its draft j."""
        size = len(q.token_ids)
        if j == 0:
            ids, first = q.token_ids[start:], start
        else:
            ids, first = (PENDING_TOKEN,), size - 1 + j
        s = replace(q.sampling, seed=((q.sampling.seed or 0) ^ DRAFT_SALT) & 0xFFFFFFFF,
                    logprobs=None)
        return self.runner.row(q.request_id, ids, first, q.block_table, sampling=s,
                               sample_index=size + j - q.num_prompt_tokens)
