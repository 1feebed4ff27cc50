"""One sequence's share of a runner call (`RowInput`: its plan row, token cell and how it
samples)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xlaserve.serving.scheduler.step_plan import ScheduledSeq


@dataclass(frozen=True)
class RowSampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    counter: int = 0              # index of the token this row samples (RNG stream position)
    bias: np.ndarray | None = None  # [V] additive logit bias (penalties), None = zeros
    logprobs: bool = False        # compute this row's logprobs (and the top 20)


GREEDY = RowSampling()


@dataclass(frozen=True)
class RowInput:
    """One sequence's share of a call: its row of the step plan (PENDING_TOKEN inputs are
    filled from the token cell), the token cell its sampled tokens live in on device (in
    [1, max_num_seqs]), and how it samples.  `ModelRunner.row` makes one by hand."""

    seq: ScheduledSeq
    token_cell: int
    sampling: RowSampling = GREEDY
    # [num_draft, V] float32: the draft model's distribution each draft was drawn from (a
    # verify row of a sampling request under method "draft"); None: point-mass drafts
    draft_probs: np.ndarray | None = None
