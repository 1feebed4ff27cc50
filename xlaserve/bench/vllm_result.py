"""`bench online --save-result`: one rate's run as the JSON `vllm bench serve --save-result`
writes, field for field, so a run compares with published vLLM results and their tooling.

    setup     date, endpoint_type, backend, label, model_id, tokenizer_id, num_prompts,
              request_rate ("inf" or req/s), burstiness, max_concurrency, [--metadata K=V]
    totals    duration, completed, failed, total_input_tokens, total_output_tokens,
              request_throughput, request_goodput (None without --goodput), output_throughput,
              total_token_throughput, max_output_tokens_per_s, max_concurrent_requests, rtfx
    per request (every sent one, in send order)  latencies, queue_times, errors; with
              --save-detailed also input_lens, output_lens, ttfts, itls, start_times,
              generated_texts
    per metric (--percentile-metrics, default ttft,tpot,itl,e2el; with --max-concurrency also
              client_queue_time)  mean_<m>_ms, median_<m>_ms, std_<m>_ms, p<q>_<m>_ms for each
              --metric-percentiles q (default 99)

As in vLLM: failed requests count 0 in the per-request lists; TPOT is (latency - TTFT) /
(tokens - 1) over requests of two or more tokens; ITL pools every gap; a metric with no values
reports 0; total_input_tokens sums the dataset's prompt lengths of the completed requests (the
usage's prompt_tokens where the dataset has none); max_output_tokens_per_s is the most output
tokens whose arrival fell in one whole second of the run, max_concurrent_requests the most
completed requests in flight at once.  The default file name is vLLM's:
`{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from xlaserve.bench.online_report import record_values
from xlaserve.bench.stream_client import TextRequest

METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time")
BACKENDS = {"completions": "openai", "chat": "openai-chat"}   # vLLM's --backend names
DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts")


@dataclass(frozen=True)
class SaveOptions:
    result_dir: str | None = None
    result_filename: str | None = None
    label: str | None = None
    detailed: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    metric_percentiles: tuple[float, ...] = (99.0,)

    def __post_init__(self) -> None:
        bad = [m for m in self.percentile_metrics if m not in METRICS]
        if bad:
            raise ValueError(f"--percentile-metrics {','.join(bad)}: choose from "
                             f"{','.join(METRICS)}")
        bad_q = [q for q in self.metric_percentiles if not 0 <= q <= 100]
        if bad_q or not self.metric_percentiles:
            raise ValueError(f"--metric-percentiles {bad_q or '(none)'}: need values in "
                             "[0, 100]")

    def path(self, label: str, rate: float, max_concurrency: int | None, model: str,
             date: str) -> Path:
        concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
        name = self.result_filename or (f"{label}-{_rate(rate)}qps{concurrency}-"
                                        f"{model.split('/')[-1]}-{date}.json")
        return Path(self.result_dir or ".") / name


def _rate(rate: float) -> str | float:
    return "inf" if math.isinf(rate) else rate


def _stats(values: list[float], percentiles: tuple[float, ...], name: str) -> dict[str, float]:
    """vLLM's mean/median/std/p<q> of `values` (seconds) in ms; 0 for no values."""
    a = np.asarray(values or [0.0], dtype=np.float64) * 1e3
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
           f"std_{name}_ms": float(a.std())}
    for q in percentiles:
        word = str(int(q)) if int(q) == q else str(q)
        out[f"p{word}_{name}_ms"] = float(np.percentile(a, q))
    return out


def _peaks(records: list[dict[str, Any]]) -> tuple[float, int]:
    """(most output tokens arriving in one second, most completed requests in flight)."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return 0.0, 0
    t0 = min(r["sent_s"] for r in ok)
    seconds = int(np.ceil(max(r["sent_s"] + r["latency_s"] for r in ok) - t0)) + 1
    per_second = np.zeros(seconds)
    events = []
    for r in ok:
        if r["ttft_s"] is not None:
            times = r["sent_s"] + r["ttft_s"] + np.concatenate([[0.0], np.cumsum(r["itl_s"])])
            np.add.at(per_second, np.clip((times - t0).astype(int), 0, seconds - 1), 1)
        events += [(r["sent_s"], 1), (r["sent_s"] + r["latency_s"], -1)]
    in_flight = peak = 0
    for _, delta in sorted(events):   # a departure sorts before an arrival at the same time
        in_flight += delta
        peak = max(peak, in_flight)
    return float(per_second.max()), peak


def vllm_result(summary: dict[str, Any], requests: list[TextRequest], *, endpoint_kind: str,
                model: str, tokenizer_id: str | None, max_concurrency: int | None,
                goodput_set: bool, save: SaveOptions, date: str | None = None
                ) -> dict[str, Any]:
    """The result dict of one rate (`summary` as online_report.summarize makes it, with its
    per-request records under "requests", sent in the order of `requests`)."""
    records = summary["requests"]
    prompt_len = {r.request_id: r.prompt_tokens for r in requests}
    ok = [r for r in records if r["status"] == "ok"]
    input_lens = [prompt_len.get(r["request_id"]) or r["prompt_tokens"] or 0 for r in records]
    output_lens = [r["output_tokens"] if r["status"] == "ok" else 0 for r in records]
    total_in = sum(n for n, r in zip(input_lens, records) if r["status"] == "ok")
    total_out = sum(output_lens)
    dur = max(summary["wall_s"], 1e-9)
    peak_tokens, peak_requests = _peaks(records)
    backend = BACKENDS[endpoint_kind]
    result: dict[str, Any] = {
        "date": date or datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend, "backend": backend, "label": save.label,
        "model_id": model, "tokenizer_id": tokenizer_id, "num_prompts": len(records),
        **save.metadata,
        "request_rate": _rate(summary["rate"]), "burstiness": 1.0,
        "max_concurrency": max_concurrency,
        "duration": summary["wall_s"], "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": summary["goodput"]["rate_per_s"] if goodput_set else None,
        "output_throughput": total_out / dur, "total_token_throughput": (total_in + total_out)
        / dur,
        "input_lens": input_lens, "output_lens": output_lens,
        "ttfts": [(r["ttft_s"] or 0.0) if r["status"] == "ok" else 0.0 for r in records],
        "itls": [r["itl_s"] if r["status"] == "ok" else [] for r in records],
        "latencies": [(r["latency_s"] or 0.0) if r["status"] == "ok" else 0.0 for r in records],
        "start_times": [r["sent_s"] for r in records],
        "queue_times": [max(0.0, r["sent_s"] - r["scheduled_s"]) for r in records],
        "generated_texts": [r["text"] for r in records],
        "errors": [r["error"] or "" for r in records],
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_requests,
        "rtfx": 0.0,
    }
    values = {m: record_values(summary, key) for m, key in
              (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("itl", "itl_s"), ("e2el", "latency_s"))}
    values["client_queue_time"] = [max(0.0, r["sent_s"] - r["scheduled_s"]) for r in ok]
    for m in save.percentile_metrics:
        result.update(_stats(values[m], save.metric_percentiles, m))
    if max_concurrency is not None and "client_queue_time" not in save.percentile_metrics:
        result.update(_stats(values["client_queue_time"], save.metric_percentiles,
                             "client_queue_time"))
    if not save.detailed:
        for key in DETAILED:
            del result[key]
    return result
