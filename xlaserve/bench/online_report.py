"""What one rate of `bench online` measured: latency distributions, throughput, goodput.

    summarize(rate, records, wall_s, slo) -> {
        "rate", "sent", "unsent", "completed", "failed", "statuses": {status: count},
        "wall_s", "request_throughput", "output_tokens", "output_tokens_per_s",
        "usage_reported",                          # requests whose count came from usage
        "ttft_s" | "tpot_s" | "itl_s" | "e2e_s": {"n", "mean", "p50", "p90", "p99"},
        "goodput": {"ttft_s", "tpot_s", "requests", "fraction", "rate_per_s"}}

Latency distributions cover the completed ("ok") requests; ITL pools every gap of every one of
them.  Throughput divides completed requests and their output tokens by the rate's wall time.
Goodput counts requests that completed with TTFT <= slo.ttft_s and TPOT <= slo.tpot_s (a
one-token answer has no TPOT and passes that half); its fraction is over every sent request, so
failures count against it.  `sent == completed + failed == sum(statuses)` always holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.bench.stream_client import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.2

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"--slo-ttft {self.ttft_s} and --slo-tpot {self.tpot_s} must "
                             "be > 0")

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        first = r.ttft_s if r.ttft_s is not None else r.latency_s   # no text: the whole wait
        tpot = r.tpot_s
        return first is not None and first <= self.ttft_s and (tpot is None
                                                               or tpot <= self.tpot_s)


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
        "goodput": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "requests": good,
                    "fraction": good / len(records) if records else 0.0,
                    "rate_per_s": good / wall},
    }


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
    body = [_row(s) for s in summaries]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, h in enumerate(HEAD)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(HEAD), rule, *(line(r) for r in body)])
