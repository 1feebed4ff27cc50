"""The PNG of `bench online --plot`: TTFT, TPOT and ITL, each as p50/p99 against offered
request rate (top row) and as its distribution at every rate (bottom row: the empirical CDF,
one line per rate, milliseconds on a log axis).

    summaries (online_report.summarize, per-request records under "requests")
        top:    rate position --> p50 (o-), p99 (s--)          one panel per metric
        bottom: sorted values --> fraction of requests <= x     one line per rate

Drawn on a bare matplotlib `Figure` with the Agg canvas (no pyplot, no global backend switch,
no display needed).  Rates sit at evenly spaced positions labelled with their value, which
reads like a log axis for the usual doubling sweeps and leaves room for `inf`; a rate with no
completed request leaves a gap above and no line below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from xlaserve.bench.online_report import rate_label, record_values

PANELS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"))
SIZE = (12, 7)   # inches at 100 dpi: 1200 x 700 pixels


def plot_latency(summaries: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    fig = Figure(figsize=SIZE, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    xs = list(range(len(summaries)))
    labels = [rate_label(s["rate"]) for s in summaries]
    axes = fig.subplots(2, len(PANELS))
    for (top, bottom), (key, name) in zip(axes.T, PANELS):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [float("nan") if s[key][q] is None else s[key][q] * 1e3 for s in summaries]
            top.plot(xs, ys, style, label=f"{name} {q}")
        top.set_xticks(xs, labels)
        top.set_xlabel("offered request rate (req/s)")
        top.set_ylabel(f"{name} (ms)")
        top.set_ylim(bottom=0)
        top.grid(True, alpha=0.3)
        top.legend()
        for s, label in zip(summaries, labels):
            values = np.sort(np.asarray(record_values(s, key))) * 1e3
            if values.size:
                frac = np.arange(1, values.size + 1) / values.size
                bottom.step(values, frac, where="post", label=f"{label} req/s")
        bottom.set_xscale("log")
        bottom.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        bottom.xaxis.set_major_formatter(ScalarFormatter())   # 20, 50, 100: not 2x10^1
        bottom.xaxis.set_minor_formatter(NullFormatter())
        bottom.set_xlabel(f"{name} (ms)")
        bottom.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of gaps")
        bottom.set_ylim(0, 1.02)
        bottom.grid(True, alpha=0.3, which="both")
        if bottom.lines:
            bottom.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.savefig(path, format="png")
