"""What one rate of `bench online` measured: latency distributions, throughput, goodput.

    summarize(rate, records, wall_s, slo) -> {
        "rate", "sent", "unsent", "completed", "failed", "statuses": {status: count},
        "wall_s", "request_throughput", "output_tokens", "output_tokens_per_s",
        "usage_reported",                          # requests whose count came from usage
        "ttft_s" | "tpot_s" | "itl_s" | "e2e_s": {"n", "mean", "p50", "p90", "p99"},
        "goodput": {"ttft_s", "tpot_s", "e2el_s", "requests", "fraction", "rate_per_s"}}

Latency distributions cover the completed ("ok") requests; ITL pools every gap of every one of
them.  Throughput divides completed requests and their output tokens by the rate's wall time.
Goodput counts requests that completed within every objective of the SLO (TTFT, TPOT, E2EL;
a one-token answer has no TPOT and passes that one); its fraction is over every sent request, so
failures count against it.  `sent == completed + failed == sum(statuses)` always holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.bench.report import markdown_table
from xlaserve.bench.stream_client import RequestRecord

PERCENTILES = (50, 90, 99)


GOODPUT_METRICS = ("ttft", "tpot", "e2el")   # `--goodput NAME:MS` names, as vLLM's


@dataclass(frozen=True)
class SLO:
    """Per-request latency objectives, seconds; None: not checked.  A request is good when it
    completed and meets every one that is set."""

    ttft_s: float | None = 1.0
    tpot_s: float | None = 0.2
    e2el_s: float | None = None

    def __post_init__(self) -> None:
        for name, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("e2el", self.e2el_s)):
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} {v} must be > 0 (--slo-{name}, --goodput "
                                 f"{name}:MS)")

    @classmethod
    def from_goodput(cls, pairs: list[str]) -> SLO:
        """vLLM's `--goodput ttft:500 tpot:50 [e2el:MS]` (milliseconds): only the named
        objectives are checked."""
        ms: dict[str, float] = {}
        for pair in pairs:
            name, _, value = pair.partition(":")
            if name not in GOODPUT_METRICS:
                raise ValueError(f"--goodput {pair!r}: the metric must be one of "
                                 f"{', '.join(GOODPUT_METRICS)}")
            try:
                ms[name] = float(value)
            except ValueError:
                raise ValueError(f"--goodput {pair!r}: expected NAME:MILLISECONDS") from None
        if not ms:
            raise ValueError("--goodput: give one or more NAME:MILLISECONDS pairs")
        return cls(**{f"{k}_s": ms[k] / 1e3 if k in ms else None for k in GOODPUT_METRICS})

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        first = r.ttft_s if r.ttft_s is not None else r.latency_s   # no text: the whole wait
        tpot = r.tpot_s      # None for a one-token answer: passes the TPOT objective
        return (first is not None and (self.ttft_s is None or first <= self.ttft_s)
                and (self.tpot_s is None or tpot is None or tpot <= self.tpot_s)
                and (self.e2el_s is None or (r.latency_s or 0.0) <= self.e2el_s))

    def describe(self) -> str:
        parts = [f"{n} <= {v:g} s" for n, v in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s),
                                               ("E2EL", self.e2el_s)) if v is not None]
        return " and ".join(parts)


def distribution(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64)
    return {"n": len(values), "mean": float(a.mean()),
            **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}


def summarize(rate: float, records: list[RequestRecord], wall_s: float, slo: SLO,
              unsent: int = 0) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    wall = max(wall_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    good = sum(slo.met(r) for r in records)
    return {
        "rate": rate,
        "sent": len(records),
        "unsent": unsent,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "statuses": dict(sorted(statuses.items())),
        "wall_s": wall_s,
        "request_throughput": len(ok) / wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "usage_reported": sum(r.usage_reported for r in ok),
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_s": distribution([g for r in ok for g in r.itl_s]),
        "e2e_s": distribution([r.latency_s for r in ok if r.latency_s is not None]),
        "goodput": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2el_s": slo.e2el_s,
                    "requests": good,
                    "fraction": good / len(records) if records else 0.0,
                    "rate_per_s": good / wall},
    }


def record_values(summary: dict[str, Any], key: str) -> list[float]:
    """One metric's values (seconds) over the rate's completed requests (`summary`
    with its per-request records under "requests", as JSON); ITL pools the gaps."""
    ok = [r for r in summary["requests"] if r["status"] == "ok"]
    if key == "itl_s":
        return [g for r in ok for g in r["itl_s"]]
    return [r[key] for r in ok if r[key] is not None]


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(d: dict[str, Any], q: str) -> str:
    return "-" if d[q] is None else f"{d[q] * 1e3:.0f}"


def _row(s: dict[str, Any]) -> list[str]:
    fails = ", ".join(f"{k} {v}" for k, v in s["statuses"].items() if k != "ok") or "-"
    pair = {k: f"{_ms(s[k], 'p50')} / {_ms(s[k], 'p99')}"
            for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")}
    g = s["goodput"]
    return [rate_label(s["rate"]), str(s["sent"]), str(s["completed"]), fails,
            f"{s['request_throughput']:.2f}", f"{s['output_tokens_per_s']:.1f}",
            pair["ttft_s"], pair["tpot_s"], pair["itl_s"], pair["e2e_s"],
            f"{g['fraction']:.0%} ({g['rate_per_s']:.2f}/s)"]


HEAD = ["rate req/s", "sent", "ok", "failed", "req/s", "out tok/s", "TTFT p50/p99 ms",
        "TPOT p50/p99 ms", "ITL p50/p99 ms", "E2E p50/p99 ms", "goodput"]


def format_rate_table(summaries: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per rate."""
    return markdown_table(HEAD, [_row(s) for s in summaries])
