"""The bucket plan: every shape the device step is compiled for.

A call is `[rows, tokens]` with a block-table width `W`:
  decode   rows in `decode_batch_sizes`, tokens = 1
  prefill  tokens (chunk length) in `prefill_chunk_sizes`, rows in powers of two up to
           `max_prefill_rows` with rows * tokens <= `max_prefill_tokens`, so many short prompts
           share one call
  width    every call also picks W from `table_widths` (blocks per row the attention reads);
           a chunk of T tokens needs at least T / block_size blocks, so narrower widths are
           not compiled for it
All of them compile during warm-up; serving pads each batch up to the next bucket.  Sampling is
compiled separately, once per row count.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class BucketPlan:
    decode_batch_sizes: tuple[int, ...]
    prefill_chunk_sizes: tuple[int, ...]
    max_prefill_tokens: int
    table_widths: tuple[int, ...]
    block_size: int = 16
    max_prefill_rows: int = 8

    def __post_init__(self) -> None:
        for name in ("decode_batch_sizes", "prefill_chunk_sizes", "table_widths"):
            v = getattr(self, name)
            if not v or list(v) != sorted(set(v)) or v[0] < 1:
                raise ValueError(f"BucketPlan.{name} must be strictly increasing positive ints, "
                                 f"got {v}")
        if self.max_prefill_tokens < self.prefill_chunk_sizes[-1]:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} is smaller than the "
                             f"largest chunk {self.prefill_chunk_sizes[-1]}")

    @classmethod
    def for_limits(cls, *, max_num_seqs: int, max_chunk: int, max_prefill_tokens: int,
                   max_width: int, min_chunk: int = 16, min_width: int = 4,
                   block_size: int = 16, max_prefill_rows: int = 8) -> "BucketPlan":
        return cls(decode_batch_sizes=powers_of_two(1, max_num_seqs),
                   prefill_chunk_sizes=powers_of_two(min(min_chunk, max_chunk), max_chunk),
                   max_prefill_tokens=max_prefill_tokens,
                   table_widths=powers_of_two(min(min_width, max_width), max_width),
                   block_size=block_size, max_prefill_rows=max_prefill_rows)

    @property
    def max_chunk(self) -> int:
        return self.prefill_chunk_sizes[-1]

    def prefill_rows(self, chunk: int) -> tuple[int, ...]:
        return powers_of_two(1, max(1, min(self.max_prefill_rows,
                                           self.max_prefill_tokens // chunk)))

    def prefill_widths(self, chunk: int) -> tuple[int, ...]:
        need = -(-chunk // self.block_size)
        wide = tuple(w for w in self.table_widths if w >= need)
        return wide or self.table_widths[-1:]

    def shapes(self) -> list[tuple[int, int, int]]:
        """All (rows, tokens, width) buckets of the forward pass."""
        out = [(b, 1, w) for b in self.decode_batch_sizes for w in self.table_widths]
        for t in self.prefill_chunk_sizes:
            out += [(r, t, w) for r in self.prefill_rows(t) for w in self.prefill_widths(t)]
        return out

    def sample_rows(self) -> tuple[int, ...]:
        """Row counts the sampler is compiled for."""
        rows = set(self.decode_batch_sizes)
        for t in self.prefill_chunk_sizes:
            rows.update(self.prefill_rows(t))
        return tuple(sorted(rows))

    @staticmethod
    def _fit(sizes: tuple[int, ...], n: int, what: str) -> int:
        i = bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{what}={n} exceeds the largest bucket {sizes[-1]}")
        return sizes[i]

    def decode_rows(self, n: int) -> int:
        return self._fit(self.decode_batch_sizes, n, "decode batch")

    def chunk(self, n: int) -> int:
        return self._fit(self.prefill_chunk_sizes, n, "prefill chunk")

    def rows(self, chunk: int, n: int) -> int:
        return self._fit(self.prefill_rows(chunk), n, f"prefill rows of chunk {chunk}")

    def width(self, n: int, chunk: int = 1) -> int:
        return self._fit(self.prefill_widths(chunk) if chunk > 1 else self.table_widths, n,
                         "block-table width")
