"""`xlaserve bench online`: a named workload sent to any OpenAI-compatible server as Poisson
arrivals, one run per request rate, every request streamed and timed chunk by chunk.

    workload spec --build--> token-id prompts --decode--> TextRequest[]     text_requests()
        (--dataset random|sharegpt-like|prefix-repetition: vLLM's shapes, datasets.py;
        no tokenizer at hand: the corpus cut into words instead, see CorpusWords)
    rate r: arrival gaps ~ Exp(mean 1/r), the same seeded draws at every rate  poisson_arrivals()
        each arrival --stream_client.send--> RequestRecord                    run_rate()
        (--max-concurrency N: at most N requests in flight, the next one sent as one finishes:
        with rate inf, a closed loop at fixed concurrency, as `vllm bench serve` runs it)
    RequestRecord[] + wall time + SLO --> one summary per rate             online_report.py
    summaries --> table (stdout), JSON (--json), PNG (--plot), and per rate the JSON
        `vllm bench serve --save-result` writes (--save-result, vllm_result.py)

Every rate sends the same requests in the same order, so the rates differ only in spacing.  A
rate's run sends nothing after `duration_s` and ends once every sent request has finished or hit
its timeout; its wall time runs from the first send to the last finish.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import numpy as np
from tqdm import tqdm

from xlaserve.bench.datasets import DatasetOptions, build_dataset, describe
from xlaserve.bench.online_report import SLO, format_rate_table, rate_label, summarize
from xlaserve.bench.stream_client import Endpoint, RequestRecord, TextRequest, send
from xlaserve.bench.vllm_result import SaveOptions, vllm_result
from xlaserve.bench.workload import get_workload

if TYPE_CHECKING:
    from xlaserve.serving.tokenizer import Tokenizer


@dataclass(frozen=True)
class OnlineOptions:
    workload: str = "mixed"
    rates: tuple[float, ...] = (1.0,)   # requests/s; math.inf sends every request at once
    num_requests: int | None = None     # per rate; None: the workload's own count
    duration_s: float | None = None     # per rate: no request is sent after this
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    progress: bool = True
    max_concurrency: int | None = None  # requests in flight at most; None: unbounded
    dataset: DatasetOptions | None = None   # vLLM's dataset shapes instead of the workload
    goodput_set: bool = False           # the SLO came from --goodput (vLLM's request_goodput)

    def __post_init__(self) -> None:
        if not self.rates or not all(r > 0 for r in self.rates):
            raise ValueError(f"--rates {self.rates}: need one or more rates > 0 (or inf)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency {self.max_concurrency} must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests {self.num_requests} must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration {self.duration_s} must be > 0")
        get_workload(self.workload)


def parse_rates(text: str) -> tuple[float, ...]:
    """'0.5,1,2' -> (0.5, 1.0, 2.0); 'inf' is every request at once."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--rates {text!r}: expected comma-separated numbers or inf") from None


class CorpusWords:
    """Stands in for the served model's tokenizer when none is at hand: one 'token' per
    whitespace-separated word of the corpus (about 1.3 BPE tokens per English word), so the
    workload's prompt lengths become word counts."""

    def __init__(self) -> None:
        self._words: list[str] = []
        self._ids: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for w in re.findall(r"\S+", text):
            if w not in self._ids:
                self._ids[w] = len(self._words)
                self._words.append(w)
            out.append(self._ids[w])
        return out

    def decode(self, ids: list[int]) -> str:
        return " ".join(self._words[i] for i in ids)


DEFAULT_NUM_PROMPTS = 1000   # vLLM's --num-prompts default, for --dataset


def text_requests(workload: str, tokenizer: Tokenizer | None, seed: int = 0,
                  num_requests: int | None = None, dataset: DatasetOptions | None = None
                  ) -> tuple[list[TextRequest], dict[str, Any]]:
    """The workload's (or the dataset's) requests as text prompts (its token ids decoded;
    corpus words without a tokenizer), and its description for the report."""
    words = CorpusWords() if tokenizer is None else None
    # CorpusWords has the two methods build() and decode below use; it is no Tokenizer.
    tok = cast("Tokenizer", words) if words is not None else tokenizer
    assert tok is not None
    units = "words" if words else "tokens"
    if dataset is not None:
        reqs = build_dataset(dataset, tok, seed, num_requests or DEFAULT_NUM_PROMPTS)
        return reqs, {**describe(dataset, reqs), "seed": seed, "prompt_units": units}
    spec = get_workload(workload)
    w = spec.build(tok, seed, num_requests)
    requests = [TextRequest(r.request_id, tok.decode(list(r.prompt_token_ids)),
                            r.num_output_tokens, len(r.prompt_token_ids)) for r in w.requests]
    return requests, {**w.describe(), "prompt_units": units}


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Send times in seconds, the first at 0: [n], gaps exponential with mean 1/rate.  The
    same seed draws the same unit gaps at every rate, scaled by 1/rate."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0, n) / rate
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def run_rate(endpoint: Endpoint, requests: list[TextRequest], rate: float,
                   options: OnlineOptions) -> tuple[list[RequestRecord], float, int]:
    """(records of the sent requests, wall seconds, number not sent because of duration)."""
    arrivals = poisson_arrivals(len(requests), rate, options.seed)
    planned = [(req, float(at)) for req, at in zip(requests, arrivals)
               if options.duration_s is None or at < options.duration_s]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    bar = tqdm(total=len(planned), desc=f"rate {rate_label(rate)} req/s", unit="req",
               disable=not options.progress, leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(endpoint.timeout_s),
                                 limits=limits) as client:
        t0 = time.perf_counter()

        failures: dict[str, int] = {}
        slots = asyncio.Semaphore(options.max_concurrency or len(planned) or 1)

        async def one(req: TextRequest, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with slots:   # requests wait here, in arrival order, for a free slot
                record = await send(client, endpoint, req, t0, at)
            if not record.ok:
                failures[record.status] = failures.get(record.status, 0) + 1
                bar.set_postfix(failures, refresh=False)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(req, at) for req, at in planned))
        wall = time.perf_counter() - t0
    bar.close()
    return list(records), wall, len(requests) - len(planned)


def run_sweep(endpoint: Endpoint, requests: list[TextRequest],
              options: OnlineOptions) -> list[dict[str, Any]]:
    """One summary per rate, each with its per-request records under "requests"."""
    results = []
    for rate in options.rates:
        records, wall, unsent = asyncio.run(run_rate(endpoint, requests, rate, options))
        summary = summarize(rate, records, wall, options.slo, unsent)
        results.append({**summary, "requests": [r.to_json() for r in records]})
    return results


def _json_safe(x: Any) -> Any:
    """inf (a burst rate) as the string "inf": strict JSON has no Infinity."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def save_results(results: list[dict[str, Any]], requests: list[TextRequest],
                 endpoint: Endpoint, options: OnlineOptions, save: SaveOptions,
                 tokenizer_id: str | None) -> list[Path]:
    """One vLLM-format result file per rate (see vllm_result.py); returns their paths."""
    if save.result_filename and len(results) > 1:
        raise ValueError(f"--result-filename {save.result_filename!r} names one file, but "
                         f"{len(results)} rates ran: leave it out (each rate gets vLLM's "
                         "default name) or run one rate")
    paths = []
    for summary in results:
        result = vllm_result(summary, requests, endpoint_kind=endpoint.kind,
                             model=endpoint.model, tokenizer_id=tokenizer_id,
                             max_concurrency=options.max_concurrency,
                             goodput_set=options.goodput_set, save=save)
        path = save.path(save.label or result["backend"], summary["rate"],
                         options.max_concurrency, endpoint.model, result["date"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_json_safe(result), allow_nan=False))
        paths.append(path)
    return paths


def online_main(endpoint: Endpoint, options: OnlineOptions, tokenizer_dir: str | None,
                json_path: str | None, plot_path: str | None,
                save: SaveOptions | None = None) -> int:
    tokenizer = None
    if tokenizer_dir is not None:
        from xlaserve.serving.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(tokenizer_dir)
    requests, workload = text_requests(options.workload, tokenizer, options.seed,
                                       options.num_requests, options.dataset)
    results = run_sweep(endpoint, requests, options)
    concurrency = f", at most {options.max_concurrency} in flight" \
        if options.max_concurrency else ""
    print(f"{endpoint.kind} at {endpoint.url}, model {endpoint.model}, "
          f"{'dataset' if options.dataset else 'workload'} {workload['name']} "
          f"({len(requests)} requests/rate{concurrency}), SLO {options.slo.describe()}")
    print(format_rate_table(results))
    if json_path:
        report = {"endpoint": endpoint.describe(), "workload": workload,
                  "options": {"rates": list(options.rates), "num_requests": len(requests),
                              "duration_s": options.duration_s, "seed": options.seed,
                              "max_concurrency": options.max_concurrency},
                  "slo": {"ttft_s": options.slo.ttft_s, "tpot_s": options.slo.tpot_s,
                          "e2el_s": options.slo.e2el_s},
                  "rates": results}
        Path(json_path).write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False))
        print(f"wrote {json_path}")
    if save is not None:
        for path in save_results(results, requests, endpoint, options, save, tokenizer_dir):
            print(f"wrote {path}")
    if plot_path:
        from xlaserve.bench.latency_plot import plot_latency

        plot_latency(results, plot_path, title=f"{endpoint.model} @ {endpoint.base_url}, "
                                               f"{workload['name']}")
        print(f"wrote {plot_path}")
    return 0
