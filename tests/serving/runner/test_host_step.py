"""host_step.lay_out: a step's rows as one padded flat batch, every field checked by hand on a
step that holds each kind of row (a decode, a prefill chunk that does not sample, a last chunk
that does, a verify row with a draft model's distributions), and the bad rows refused by name.
Host-only (numpy): runs without jax (tests/test_jax_free.py)."""

from __future__ import annotations

import numpy as np
import pytest

from xlaserve.models.kv_slots import slot_mapping
from xlaserve.serving.runner.host_step import HostStep, lay_out, sample_rows
from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN, ScheduledSeq
from xlaserve.serving.types import GREEDY, SamplingParams

BS, V = 4, 8


def seq(rid: str, tokens: tuple[int, ...], start: int, table: tuple[int, ...],
        sample: bool = True, num_draft: int = 0, sampling: SamplingParams = GREEDY,
        sample_index: int = 0) -> ScheduledSeq:
    return ScheduledSeq(rid, tokens, start, table, slot_mapping(table, start, len(tokens), BS),
                        sample, num_draft, sampling, sample_index)


def mixed_rows() -> list[ScheduledSeq]:
    return [
        seq("decode", (PENDING_TOKEN,), 5, (3, 7), sample_index=4, sampling=SamplingParams(
            temperature=0.5, top_k=V + 1, seed=2**33 + 9, logprobs=0)),
        seq("chunk", (11, 12, 13), 0, (2,), sample=False),
        seq("last", (21, 22), 4, (5, 6), sampling=SamplingParams(temperature=0.0, top_k=3,
                                                                 top_p=0.9)),
        seq("verify", (31, 32, 33), 2, (9, 10), num_draft=2, sample_index=7,
            sampling=SamplingParams(temperature=1.0)),   # no seed: 0
    ]


def mixed_step() -> HostStep:
    """`mixed_rows` in token cells 1..4, the decode with a penalty bias, the verify row with
    its drafts' distributions."""
    bias = {"decode": np.arange(V, dtype=np.float32)}
    q = {"verify": np.full((2, V), 1 / V, np.float32)}
    return lay_out(mixed_rows(), [1, 2, 3, 4], (8, 12, 3), BS, V, bias, q)


def test_a_mixed_step_laid_out_field_by_field() -> None:
    h = mixed_step()
    assert h.shape == (8, 12, 3)
    #                          decode | chunk     | last   | verify     | padding
    assert h.tokens.tolist() == [-1, 11, 12, 13, 21, 22, 31, 32, 33, 0, 0, 0]
    assert h.positions.tolist() == [5, 0, 1, 2, 4, 5, 2, 3, 4, 0, 0, 0]
    assert h.token_rows.tolist() == [0, 1, 1, 1, 2, 2, 3, 3, 3, -1, -1, -1]
    assert h.slot_mapping.tolist() == [29, 8, 9, 10, 24, 25, 38, 39, 40, 0, 0, 0]
    assert h.block_tables.tolist() == [[3, 7, 0], [2, 0, 0], [5, 6, 0], [9, 10, 0],
                                       [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    # sample rows: plan rows keep their index; the verify row's two drafts take rows 4 and 5
    assert sample_rows([0, 0, 0, 2]) == ((0,), (1,), (2,), (4, 5, 3))
    assert h.logits_index.tolist() == [0, 3, 5, 8, 6, 7, 0, 0]
    assert h.row_cell.tolist() == [1, 2, 3, 4, 0, 0, 0, 0]
    assert h.sample_mask.tolist() == [True, False, True, True] + [False] * 4
    assert h.temperature.tolist() == [0.5, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert h.top_k.tolist() == [0, 0, 3, 0, 0, 0, 0, 0]      # top_k >= vocab: off
    assert np.allclose(h.top_p, [1, 1, 0.9, 1, 1, 1, 1, 1])
    assert h.seed.tolist() == [9, 0, 0, 0, 0, 0, 0, 0]       # the low 32 bits
    assert h.counter.tolist() == [4, 0, 0, 9, 7, 8, 0, 0]     # a verify row counts on
    assert h.logprobs.tolist() == [True] + [False] * 7
    assert h.draft_token.tolist() == [-1, -1, -1, -1, 32, 33, -1, -1]
    assert h.bias is not None and h.bias[0].tolist() == list(range(V))
    assert not h.bias[1:].any()
    assert h.draft_probs is not None and np.allclose(h.draft_probs[[4, 5]], 1 / V)
    assert not h.draft_probs[[0, 1, 2, 3, 6, 7]].any()


def test_no_bias_or_draft_arrays_when_no_row_has_them() -> None:
    other = {"other": np.ones((1, V), np.float32)}   # a request that is not in the step
    h = lay_out([seq("a", (1,), 0, (1,))], [1], (1, 1, 1), BS, V, other, other)
    assert h.bias is None and h.draft_probs is None
    rows, tokens, tables = h.packed()
    assert rows.shape == (11, 1) and tokens.shape == (4, 1) and tables.shape == (1, 1)


def test_bad_rows_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="row 0 feeds no tokens"):
        lay_out([ScheduledSeq("a", (), 0, (1,), (), True)], [1], (1, 1, 1), BS, V)
    short = ScheduledSeq("a", (1, 2), 3, (1,), (7, 8), True)   # positions 3, 4: two blocks
    with pytest.raises(ValueError, match="row 0: block table of 1 blocks cannot hold "
                                         "position 4"):
        lay_out([short], [1], (1, 2, 1), BS, V)
    with pytest.raises(ValueError, match="1 rows but 2 token cells"):
        lay_out([seq("a", (1,), 0, (1,))], [1, 2], (1, 1, 1), BS, V)
