"""Where a run's device time goes, bucket by bucket (a diagnostic; no jax here).

A ModelRunner with a `CallProfile` attached waits for every call to finish and records it under
its bucket (rows, tokens, width): calls, seconds, real tokens (the tokens its rows feed) and
padded tokens (the bucket's tokens).  A bucket with one token per row (tokens == rows) is a
decode step; any other holds prefill chunks, often with decode rows beside them.  Waiting
serialises the pipeline — host scheduling of step n+1 no longer overlaps step n — so a profiled
run is slower than a timed one and is only for splitting time among buckets ("count before you
optimise").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Shape = tuple[int, int, int]   # (rows, tokens, width)


@dataclass
class BucketTime:
    calls: int = 0
    seconds: float = 0.0
    real_tokens: int = 0
    padded_tokens: int = 0


@dataclass
class CallProfile:
    buckets: dict[Shape, BucketTime] = field(default_factory=dict)

    def record(self, shape: Shape, seconds: float, real_tokens: int) -> None:
        _, tokens, _ = shape
        if seconds < 0 or not 0 < real_tokens <= tokens:
            raise ValueError(f"call {shape}: seconds={seconds}, real_tokens={real_tokens} "
                             f"(a call has 1..{tokens} real tokens)")
        b = self.buckets.setdefault(shape, BucketTime())
        b.calls += 1
        b.seconds += seconds
        b.real_tokens += real_tokens
        b.padded_tokens += tokens

    @property
    def seconds(self) -> float:
        return sum(b.seconds for b in self.buckets.values())

    def phase_seconds(self) -> dict[str, float]:
        """Seconds in decode calls (one token a row) and in calls holding prefill chunks."""
        out = {"decode": 0.0, "prefill": 0.0}
        for (rows, tokens, _), b in self.buckets.items():
            out["decode" if tokens == rows else "prefill"] += b.seconds
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One dict per bucket, the costliest first."""
        return [{"rows": r, "tokens": t, "width": w, "calls": b.calls, "seconds": b.seconds,
                 "ms_per_call": 1e3 * b.seconds / b.calls, "real_tokens": b.real_tokens,
                 "padded_tokens": b.padded_tokens}
                for (r, t, w), b in sorted(self.buckets.items(), key=lambda kv: -kv[1].seconds)]

    def format(self, top: int = 12) -> str:
        return format_rows(self.rows(), top)


def format_rows(rows: list[dict[str, Any]], top: int = 12) -> str:
    """A Markdown table of `CallProfile.rows()` (as stored in a report), the first `top` rows
    and a line summing the rest, under a line of decode / prefill totals."""
    total = sum(r["seconds"] for r in rows) or 1.0
    decode = sum(r["seconds"] for r in rows if r["tokens"] == r["rows"])
    title = (f"device calls: {total:.1f} s in all — decode {decode:.1f} s, "
             f"prefill {total - decode:.1f} s")
    head = "| bucket (rows, tokens, width) | calls | s | share | ms/call | real / padded tokens |"
    lines = [title, head, "|---|---|---|---|---|---|"]
    for row in rows[:top]:
        lines.append(f"| ({row['rows']}, {row['tokens']}, {row['width']}) | {row['calls']} "
                     f"| {row['seconds']:.2f} | {row['seconds'] / total:.0%} "
                     f"| {row['ms_per_call']:.1f} | {row['real_tokens']} / "
                     f"{row['padded_tokens']} |")
    if len(rows) > top:
        rest = rows[top:]
        lines.append(f"| {len(rest)} more buckets | {sum(r['calls'] for r in rest)} | "
                     f"{sum(r['seconds'] for r in rest):.2f} | | | |")
    return "\n".join(lines)
