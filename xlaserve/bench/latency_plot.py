"""The PNG of `bench online --plot`: TTFT and TPOT p50/p99 against offered request rate.

Drawn on a bare matplotlib `Figure` with the Agg canvas (no pyplot, no global backend switch,
no display needed).  Rates sit at evenly spaced positions labelled with their value, which
reads like a log axis for the usual doubling sweeps and leaves room for `inf`; a rate with no
completed request leaves a gap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from xlaserve.bench.online_report import rate_label

PANELS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"))


def plot_latency(summaries: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """One panel per metric, p50 and p99 lines in milliseconds."""
    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    xs = list(range(len(summaries)))
    labels = [rate_label(s["rate"]) for s in summaries]
    for ax, (key, name) in zip(fig.subplots(1, len(PANELS)), PANELS):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [float("nan") if s[key][q] is None else s[key][q] * 1e3 for s in summaries]
            ax.plot(xs, ys, style, label=f"{name} {q}")
        ax.set_xticks(xs, labels)
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.savefig(path, format="png")
