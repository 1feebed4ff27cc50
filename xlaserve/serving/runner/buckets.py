"""The bucket plan: every shape the device step is compiled for.

A step is one call over a flat batch of T tokens from R rows, block tables W wide
(rows, tokens, width):
  decode   every row feeds one token: T = R, token r is row r's (rows in `row_sizes`)
  mixed    anything else (prefill chunks, with or without decodes): T in `token_sizes`, R in
           `row_sizes` with R < T, so a mixed bucket is never mistaken for a decode one
  width    every call also picks W from `table_widths` (blocks per row the attention may read);
           a backend that reads only each row's real blocks (the CPU kernels) needs one width
All of them compile during warm-up; serving pads each step up to the next bucket.  Sampling is
compiled separately, once per row count.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class BucketPlan:
    row_sizes: tuple[int, ...]       # R of every bucket (decode batch sizes)
    token_sizes: tuple[int, ...]     # T of mixed buckets
    table_widths: tuple[int, ...]    # W of every bucket
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("row_sizes", "token_sizes", "table_widths"):
            v = getattr(self, name)
            if not v or list(v) != sorted(set(v)) or v[0] < 1:
                raise ValueError(f"BucketPlan.{name} must be strictly increasing positive ints, "
                                 f"got {v}")
        if self.token_sizes[-1] <= self.row_sizes[-1]:
            raise ValueError(f"the largest token bucket ({self.token_sizes[-1]}) must exceed the "
                             f"largest row bucket ({self.row_sizes[-1]}): a step of that many "
                             f"rows with one prefill token more needs it")

    @classmethod
    def for_limits(cls, *, max_num_seqs: int, max_num_batched_tokens: int, max_width: int,
                   min_tokens: int = 16, min_width: int = 4,
                   block_size: int = 16) -> BucketPlan:
        max_tokens = max(max_num_batched_tokens, max_num_seqs + 1)
        return cls(row_sizes=powers_of_two(1, max_num_seqs),
                   token_sizes=powers_of_two(min(min_tokens, max_tokens), max_tokens),
                   table_widths=powers_of_two(min(min_width, max_width), max_width),
                   block_size=block_size)

    def single_width(self) -> BucketPlan:
        """The same plan with only its widest table (for attention that reads real blocks)."""
        return replace(self, table_widths=self.table_widths[-1:])

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    def mixed_rows(self, tokens: int) -> tuple[int, ...]:
        return tuple(r for r in self.row_sizes if r < tokens)

    def shapes(self) -> list[tuple[int, int, int]]:
        """All (rows, tokens, width) buckets of the forward pass."""
        out = [(r, r, w) for r in self.row_sizes for w in self.table_widths]
        for t in self.token_sizes:
            out += [(r, t, w) for r in self.mixed_rows(t) for w in self.table_widths]
        return out

    def sample_rows(self) -> tuple[int, ...]:
        """Row counts the sampler is compiled for."""
        return self.row_sizes

    @staticmethod
    def _fit(sizes: tuple[int, ...], n: int, what: str) -> int:
        i = bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{what}={n} exceeds the largest bucket {sizes[-1]}")
        return sizes[i]

    def fit(self, rows: int, tokens: int, width: int) -> tuple[int, int, int]:
        """The bucket for a step of `rows` rows feeding `tokens` tokens over `width` blocks."""
        if rows < 1 or tokens < rows:
            raise ValueError(f"a step needs >= 1 row and >= 1 token per row, got {rows} rows "
                             f"and {tokens} tokens")
        r = self._fit(self.row_sizes, rows, "rows")
        t = r if tokens == rows else self._fit(self.token_sizes, max(tokens, r + 1), "tokens")
        return r, t, self._fit(self.table_widths, width, "block-table width")
