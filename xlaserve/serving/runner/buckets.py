"""The bucket plan: every shape the device step is compiled for.

A call is `[rows, tokens]` with a block-table width `W`:
  decode   rows in `decode_batch_sizes`, tokens = 1
  prefill  tokens (chunk length) in `prefill_chunk_sizes`, rows in powers of two with
           rows * tokens <= `max_prefill_tokens`, so many short prompts share one call
  width    every call also picks W from `table_widths` (blocks per row the attention reads)
All of them compile during warm-up; serving pads each batch up to the next bucket.
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
                   max_width: int, min_chunk: int = 16, min_width: int = 4) -> "BucketPlan":
        return cls(decode_batch_sizes=powers_of_two(1, max_num_seqs),
                   prefill_chunk_sizes=powers_of_two(min(min_chunk, max_chunk), max_chunk),
                   max_prefill_tokens=max_prefill_tokens,
                   table_widths=powers_of_two(min(min_width, max_width), max_width))

    @property
    def max_chunk(self) -> int:
        return self.prefill_chunk_sizes[-1]

    def prefill_rows(self, chunk: int) -> tuple[int, ...]:
        return powers_of_two(1, max(1, self.max_prefill_tokens // chunk))

    def shapes(self) -> list[tuple[int, int, int]]:
        """All (rows, tokens, width) buckets."""
        out = [(b, 1, w) for b in self.decode_batch_sizes for w in self.table_widths]
        for t in self.prefill_chunk_sizes:
            out += [(r, t, w) for r in self.prefill_rows(t) for w in self.table_widths]
        return out

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

    def width(self, n: int) -> int:
        return self._fit(self.table_widths, n, "block-table width")
