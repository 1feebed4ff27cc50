"""One call's padded host inputs: what the runner builds from rows and sends to the device.

Plain numpy arrays, so that on a multi-host mesh process 0 can hand the very same inputs to the
other processes (step_channel.py) and every process launches an identical call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from xlaserve.serving.scheduler.step_plan import ScheduledSeq


class Field(NamedTuple):
    """One per-token or per-row input of a call: its HostStep field, its dtype on the host,
    and the value padding entries hold.  In the packed buffers every field is one int32 row
    (float32 and uint32 bit for bit, bool as 0 / 1)."""

    name: str
    dtype: np.dtype
    pad: float = 0


I32, F32, U32, BOOL = (np.dtype(t) for t in (np.int32, np.float32, np.uint32, np.bool_))

# [T] each, in the order of the packed token buffer [len(TOKEN_FIELDS), T]
TOKEN_FIELDS = (
    Field("tokens", I32),           # PENDING_TOKEN = take from its row's token cell
    Field("positions", I32),
    Field("token_rows", I32, -1),   # -1 = padding
    Field("slot_mapping", I32),     # padding writes slot 0, the null block
)
# [R] each, in the order of the packed row buffer [len(ROW_FIELDS), R]
ROW_FIELDS = (
    Field("logits_index", I32),     # the token whose logits sample row r samples from
    Field("row_cell", I32),         # the token cell this row's sampled token goes to
    Field("sample_mask", BOOL),     # the row samples (its token cell is written)
    Field("temperature", F32),      # 0 = greedy
    Field("top_k", I32),            # 0 = off
    Field("top_p", F32, 1.0),       # 1 = off
    Field("min_p", F32),            # 0 = off
    Field("seed", U32),
    Field("counter", I32),          # index of the token sampled (RNG stream position)
    Field("logprobs", BOOL),        # the row wants logprobs
    Field("draft_token", I32, -1),  # the draft it verifies against draft_probs, else -1
)


class HostStep(NamedTuple):
    """One call's padded host inputs: T tokens of R rows, flat, block tables W wide: the
    TOKEN_FIELDS, the tables, the ROW_FIELDS (comments there), then the two [R, V] arrays.
    Plain numpy, so process 0 can hand it to the other processes of a multi-host mesh as it
    is.  R counts sample rows: one per plan row (at its index, its table in block_tables[i]),
    then one per draft token of its verify rows (`sample_rows`), their tables unused."""

    tokens: np.ndarray        # [T] int32
    positions: np.ndarray     # [T] int32
    token_rows: np.ndarray    # [T] int32
    slot_mapping: np.ndarray  # [T] int32
    block_tables: np.ndarray  # [R, W] int32
    logits_index: np.ndarray  # [R] int32
    row_cell: np.ndarray      # [R] int32
    sample_mask: np.ndarray   # [R] bool
    temperature: np.ndarray   # [R] float32
    top_k: np.ndarray         # [R] int32
    top_p: np.ndarray         # [R] float32
    min_p: np.ndarray         # [R] float32
    seed: np.ndarray          # [R] uint32
    counter: np.ndarray       # [R] int32
    logprobs: np.ndarray      # [R] bool
    draft_token: np.ndarray   # [R] int32
    bias: np.ndarray | None   # [R, V] float32, None = zeros (kept on device per bucket)
    # [R, V] float32: the distribution q each draft_token was drawn from (a draft model's,
    # for rows with temperature > 0); None = no such row.  One process only (not broadcast).
    draft_probs: np.ndarray | None = None

    @staticmethod
    def specs(r: int, t: int, w: int, vocab: int | None) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, dtype) of every field in order; `vocab` None = no bias array."""
        return ([((t,), f.dtype) for f in TOKEN_FIELDS] + [((r, w), I32)]
                + [((r,), f.dtype) for f in ROW_FIELDS]
                + ([((r, vocab), F32)] if vocab is not None else []))

    @classmethod
    def padding(cls, r: int, t: int, w: int) -> HostStep:
        """A call of bucket (r, t, w) that is padding throughout (no bias, no draft_probs)."""
        def full(shape: tuple[int, ...], f: Field) -> np.ndarray:
            return np.full(shape, f.pad, f.dtype)

        return cls(*(full((t,), f) for f in TOKEN_FIELDS), np.zeros((r, w), I32),
                   *(full((r,), f) for f in ROW_FIELDS), None)

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
        small transfers cost ~8x as much host time): per row [len(ROW_FIELDS), R], per token
        [len(TOKEN_FIELDS), T], and the block tables [R, W].  step_functions.unpack reads
        them back on device.  The bias, rarely there, travels on its own."""
        def stack(fields: tuple[Field, ...]) -> np.ndarray:
            return np.stack([_as_int32(getattr(self, f.name)) for f in fields])

        return stack(ROW_FIELDS), stack(TOKEN_FIELDS), self.block_tables


assert HostStep._fields == (*(f.name for f in TOKEN_FIELDS), "block_tables",
                            *(f.name for f in ROW_FIELDS), "bias", "draft_probs")


def _as_int32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.int32) if a.dtype == BOOL else a.view(np.int32)


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


def lay_out(rows: Sequence[ScheduledSeq], cells: Sequence[int], bucket: tuple[int, int, int],
            block_size: int, vocab: int, bias: Mapping[str, np.ndarray] | None = None,
            draft_probs: Mapping[str, np.ndarray] | None = None) -> HostStep:
    """`rows` (plan rows: tokens, positions, tables, sampling) as one flat batch padded to
    `bucket` (rows R, tokens T, width W): row i's tokens follow row i-1's, then padding
    (token_rows -1, slot 0: the null block); sample rows as `sample_rows` orders them.
    `cells[i]`: row i's token cell, in [1, max_num_seqs].  By request id: `bias` [V] additive
    logit bias (penalties) for each of the row's sample rows, `draft_probs` [num_draft, V] the
    distribution each draft of a verify row was drawn from (a draft model's; absent: point
    masses).  (A loop over rows: ~0.1 ms for 32 decode rows, which measured faster than a
    vectorised form at serving row counts.)"""
    if len(cells) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(cells)} token cells")
    bias, draft_probs = bias or {}, draft_probs or {}
    r, t, w = bucket
    h = HostStep.padding(r, t, w)
    bias_rows: np.ndarray | None = None
    q_rows: np.ndarray | None = None
    at = 0
    order = sample_rows([seq.num_draft for seq in rows])
    for i, (seq, where) in enumerate(zip(rows, order)):
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
        s = seq.sampling
        b, q = bias.get(seq.request_id), draft_probs.get(seq.request_id)
        # sample row where[j] samples after input token at + k - len(where) + j: the last
        # token only, or a verify row's token and each of its drafts
        for j, sr in enumerate(where):
            h.logits_index[sr] = at + k - len(where) + j
            h.temperature[sr], h.top_p[sr], h.min_p[sr] = s.temperature, s.top_p, s.min_p
            h.top_k[sr] = 0 if s.top_k >= vocab else s.top_k   # keeps every token: off
            h.seed[sr], h.counter[sr] = (s.seed or 0) & 0xFFFFFFFF, seq.sample_index + j
            h.logprobs[sr] = s.logprobs is not None
            if b is not None:
                if bias_rows is None:
                    bias_rows = np.zeros((r, vocab), np.float32)
                bias_rows[sr] = b
            if q is not None and j < seq.num_draft:   # q of draft j
                if q_rows is None:
                    q_rows = np.zeros((r, vocab), np.float32)
                q_rows[sr] = q[j]
                h.draft_token[sr] = seq.token_ids[k - len(where) + j + 1]
        at += k
        # only the row's own sample row feeds its token cell (read by a later PENDING_TOKEN)
        h.row_cell[i] = cells[i]
        h.sample_mask[i] = seq.sample
    return h._replace(bias=bias_rows, draft_probs=q_rows)
