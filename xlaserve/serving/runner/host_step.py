"""One call's padded host inputs: what the runner builds from rows and sends to the device.

Plain numpy arrays, so that on a multi-host mesh process 0 can hand the very same inputs to the
other processes (step_channel.py) and every process launches an identical call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from xlaserve.serving.runner.row_input import RowInput


class HostStep(NamedTuple):
    """One call's padded host inputs: T tokens of R rows, flat, block tables W wide.  Plain
    numpy, so process 0 can hand it to the other processes of a multi-host mesh as it is.
    R counts sample rows: one per plan row (at its index, its table in block_tables[i]),
    then one per draft token of its verify rows (`sample_rows`), their tables unused."""

    tokens: np.ndarray        # [T] int32, PENDING_TOKEN = take from its row's token cell
    positions: np.ndarray     # [T] int32
    token_rows: np.ndarray    # [T] int32, -1 = padding
    slot_mapping: np.ndarray  # [T] int32, padding writes the null block
    block_tables: np.ndarray  # [R, W] int32
    logits_index: np.ndarray  # [R] int32: the token whose logits sample row r samples from
    row_cell: np.ndarray      # [R] int32
    sample_mask: np.ndarray   # [R] bool
    temperature: np.ndarray   # [R] float32
    top_k: np.ndarray         # [R] int32
    top_p: np.ndarray         # [R] float32
    min_p: np.ndarray         # [R] float32
    seed: np.ndarray          # [R] uint32
    counter: np.ndarray       # [R] int32
    logprobs: np.ndarray      # [R] bool: the row wants logprobs
    draft_token: np.ndarray   # [R] int32: the draft this sample row verifies against
                              #   draft_probs (a draft model's sampled draft), else -1
    bias: np.ndarray | None   # [R, V] float32, None = zeros (kept on device per bucket)
    # [R, V] float32: the distribution q each draft_token was drawn from (a draft model's,
    # for rows with temperature > 0); None = no such row.  One process only (not broadcast).
    draft_probs: np.ndarray | None = None

    @staticmethod
    def specs(r: int, t: int, w: int, vocab: int | None) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, dtype) of every field in order; `vocab` None = no bias array."""
        i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
        out = [((t,), i32), ((t,), i32), ((t,), i32), ((t,), i32), ((r, w), i32),
               ((r,), i32), ((r,), i32), ((r,), np.dtype(np.bool_)),
               ((r,), f32), ((r,), i32), ((r,), f32), ((r,), f32), ((r,), np.dtype(np.uint32)),
               ((r,), i32), ((r,), np.dtype(np.bool_)), ((r,), i32)]
        return out + ([((r, vocab), f32)] if vocab is not None else [])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, tokens, width): the bucket."""
        r, w = self.block_tables.shape
        return r, self.tokens.shape[0], w

    def arrays(self) -> list[np.ndarray]:
        return [a for a in self if a is not None]

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> HostStep:
        return cls(*arrays, *([None] * (len(cls._fields) - len(arrays))))

    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The inputs as three int32 buffers, which go to the device in one transfer each (15
        small transfers cost ~8x as much host time): per row [ROW_FIELDS, R] (float32 and
        uint32 fields bit for bit), per token [TOKEN_FIELDS, T], and the block tables
        [R, W].  The bias, rarely there, travels on its own."""
        rows = np.stack([self.logits_index, self.row_cell, self.sample_mask.astype(np.int32),
                         self.temperature.view(np.int32), self.top_k,
                         self.top_p.view(np.int32), self.min_p.view(np.int32),
                         self.seed.view(np.int32), self.counter,
                         self.logprobs.astype(np.int32), self.draft_token])
        tokens = np.stack([self.tokens, self.positions, self.token_rows, self.slot_mapping])
        return rows, tokens, self.block_tables


def sample_rows(num_drafts: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Each plan row's sample rows in position order, from its draft count: row i samples its
    last token in sample row i (so plain rows keep their index); a verify row's k draft
    positions before it take the rows after every plan row's, in order.

        num_drafts (0, 2, 0, 1)  ->  ((0,), (4, 5, 1), (2,), (6, 3))
    """
    extra = len(num_drafts)
    out = []
    for i, k in enumerate(num_drafts):
        out.append(tuple(range(extra, extra + k)) + (i,))
        extra += k
    return tuple(out)


# the rows of HostStep.packed()'s buffers
ROW_FIELDS = ("logits_index", "row_cell", "sample_mask", "temperature", "top_k", "top_p",
              "min_p", "seed", "counter", "logprobs", "draft_token")
TOKEN_FIELDS = ("tokens", "positions", "token_rows", "slot_mapping")


def lay_out(rows: Sequence[RowInput], bucket: tuple[int, int, int], block_size: int,
            vocab: int) -> HostStep:
    """`rows` as one flat batch padded to `bucket` (rows R, tokens T, width W): row i's tokens
    follow row i-1's, then padding (token_rows -1, slot 0: the null block); sample rows as
    `sample_rows` orders them.  (A loop over rows: ~0.1 ms for 32 decode rows, which measured
    faster than a vectorised form at serving row counts.)"""
    r, t, w = bucket
    # every field but bias and draft_probs: zeros (padding writes slot 0, the null block),
    # then the three whose padding is not 0
    h = HostStep.from_arrays([np.zeros(shape, dt) for shape, dt in HostStep.specs(r, t, w, None)])
    h.token_rows[:] = -1
    h.top_p[:] = 1.0
    h.draft_token[:] = -1
    bias: np.ndarray | None = None
    draft_probs: np.ndarray | None = None
    at = 0
    order = sample_rows([row.seq.num_draft for row in rows])
    for i, (row, where) in enumerate(zip(rows, order)):
        seq = row.seq
        k = seq.num_tokens
        if k < 1:
            raise ValueError(f"row {i} feeds no tokens")
        if len(seq.block_table) * block_size < seq.end_position:
            raise ValueError(f"row {i}: block table of {len(seq.block_table)} blocks cannot "
                             f"hold position {seq.end_position - 1}")
        h.tokens[at:at + k] = seq.token_ids
        h.positions[at:at + k] = np.arange(seq.start_position, seq.end_position, dtype=np.int32)
        h.token_rows[at:at + k] = i
        h.slot_mapping[at:at + k] = seq.slot_mapping
        h.block_tables[i, : len(seq.block_table)] = seq.block_table
        s = row.sampling
        # sample row where[j] samples after input token at + k - len(where) + j: the last
        # token only, or a verify row's token and each of its drafts
        for j, sr in enumerate(where):
            h.logits_index[sr] = at + k - len(where) + j
            h.temperature[sr], h.top_p[sr], h.min_p[sr] = s.temperature, s.top_p, s.min_p
            h.top_k[sr] = 0 if s.top_k >= vocab else s.top_k   # keeps every token: off
            h.seed[sr], h.counter[sr] = s.seed & 0xFFFFFFFF, s.counter + j
            h.logprobs[sr] = s.logprobs
            if s.bias is not None:
                if bias is None:
                    bias = np.zeros((r, vocab), np.float32)
                bias[sr] = s.bias
            if row.draft_probs is not None and j < seq.num_draft:   # q of draft j
                if draft_probs is None:
                    draft_probs = np.zeros((r, vocab), np.float32)
                draft_probs[sr] = row.draft_probs[j]
                h.draft_token[sr] = seq.token_ids[k - len(where) + j + 1]
        at += k
        # only the row's own sample row feeds its token cell (read by a later PENDING_TOKEN)
        h.row_cell[i] = row.token_cell
        h.sample_mask[i] = seq.sample
    return h._replace(bias=bias, draft_probs=draft_probs)
