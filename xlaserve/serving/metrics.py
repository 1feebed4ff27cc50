"""Prometheus metrics, one CollectorRegistry per app (never the global one): vLLM's v1 names
and labels where the meaning is the same, `vllm:X` as `xlaserve_X` (a dashboard for vLLM
works after replacing `vllm:` by `xlaserve_`; deploy/grafana/xlaserve.json is ours), plus
xlaserve's own (admission, rejections, HTTP statuses, step costs, tenants).

    labels     model_name (the served model id, vLLM's), engine (the replica, vLLM's engine
               index), finished_reason (vLLM's), tenant (ours: token counters per tenant)
    request    time_to_first_token, inter_token_latency (every gap), e2e_request_latency,
               request_queue_time (the admission queue), request_time_per_output_token (one
               per choice: (last - first token) / (tokens - 1)), request_prefill_time (sent
               to the engine -> first token: its own wait for a batch row included),
               request_decode_time (first -> last token), request_inference_time (the two),
               request_prompt_tokens, request_generation_tokens, request_params_max_tokens,
               request_params_n (histograms); request_success, prompt_tokens,
               generation_tokens (counters)
    engine     num_requests_running / _waiting, kv_cache_usage_perc, prefix_cache_queries /
               _hits, num_preemptions: read from `engine.stats()`, and the step costs
               admission projects from (`engine.service_costs()`), at scrape time by a
               collector, so never stale and free between scrapes

Request-path metrics are observed by the front end (`Generation`, serving/http/state.py) from
the events the engines emit and the times they arrive; an engine behind gRPC is timed the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from xlaserve.serving.engine_api import AsyncEngine

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_N = (1, 2, 5, 10, 20)
MODEL = "model_name"     # vLLM's label names
ENGINE = "engine"

# One entry per engine replica: (model id, replica name, engine).
EngineSource = tuple[str, str, AsyncEngine]


class _EngineCollector(Collector):
    def __init__(self, sources: Callable[[], Iterable[EngineSource]]):
        self._sources = sources

    def collect(self) -> Iterable[Metric]:
        labels = [MODEL, ENGINE]
        g = {name: GaugeMetricFamily(f"xlaserve_{name}", doc, labels=labels) for name, doc in [
            ("num_requests_running", "Requests in the engine's running batch"),
            ("num_requests_waiting", "Requests accepted by the engine, not yet running"),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)"),
            ("kv_cache_blocks_total", "KV blocks in the pool"),
            ("kv_cache_blocks_cached", "Free KV blocks still holding a reusable prefix"),
            ("prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens (cumulative)"),
            ("step_seconds", "Measured seconds per decode step of a full batch"),
            ("step_max_running", "Sequences one step carries at most"),
            ("prefill_tokens_per_second", "Measured prompt tokens prefilled per second"),
        ]}
        c = {name: CounterMetricFamily(f"xlaserve_{name}", doc, labels=labels) for name, doc in [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            ("num_preemptions", "Requests preempted (recomputed later)"),
            ("spec_decode_num_drafts", "Speculative verify rows run (a row with drafts)"),
            ("spec_decode_num_draft_tokens", "Speculative draft tokens proposed and verified"),
            ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted"),
        ]}
        accepted = HistogramMetricFamily(
            "xlaserve_spec_decode_acceptance_length", "Tokens a speculative verify row emitted: "
            "its accepted drafts plus the target model's own token", labels=labels)
        for model, replica, engine in self._sources():
            try:
                s, costs = engine.stats(), engine.service_costs()
            except Exception:  # noqa: BLE001, S112 (a replica that cannot answer is skipped)
                continue
            lv = [model, replica]
            g["num_requests_running"].add_metric(lv, s.num_running)
            g["num_requests_waiting"].add_metric(lv, s.num_waiting)
            g["kv_cache_usage_perc"].add_metric(lv, s.kv_usage)
            g["kv_cache_blocks_total"].add_metric(lv, s.kv_blocks_total)
            g["kv_cache_blocks_cached"].add_metric(lv, s.kv_blocks_cached)
            g["prefix_cache_hit_rate"].add_metric(lv, s.prefix_cache_hit_rate)
            c["prefix_cache_queries"].add_metric(lv, s.prefix_cache_queries)
            c["prefix_cache_hits"].add_metric(lv, s.prefix_cache_hits)
            c["num_preemptions"].add_metric(lv, s.num_preemptions)
            c["spec_decode_num_drafts"].add_metric(lv, s.spec_num_drafts)
            c["spec_decode_num_draft_tokens"].add_metric(lv, s.spec_num_draft_tokens)
            c["spec_decode_num_accepted_tokens"].add_metric(lv, s.spec_num_accepted_tokens)
            if s.spec_num_drafts:
                accepted.add_metric(lv, _cumulative(s.spec_acceptance_counts),
                                    s.spec_num_drafts + s.spec_num_accepted_tokens)
            g["step_seconds"].add_metric(lv, costs.step_s)
            g["step_max_running"].add_metric(lv, costs.max_running)
            g["prefill_tokens_per_second"].add_metric(lv, costs.prefill_tokens_per_s)
        yield from g.values()
        yield from c.values()
        yield accepted
        yield self._info()

    def _info(self) -> Metric:
        """One sample of 1 per local engine, labelled with what serves it (an engine behind gRPC
        has no `kernels` here: its worker logs them at start-up)."""
        keys = ("attention_backend", "platform", "dtype", "quantization")
        info = GaugeMetricFamily("xlaserve_engine_info", "Kernels a local engine serves with "
                                 "(value 1)", labels=[MODEL, ENGINE, *keys])
        for model, replica, engine in self._sources():
            kernels = getattr(engine, "kernels", None)
            if isinstance(kernels, dict):
                info.add_metric([model, replica, *(str(kernels.get(k, "")) for k in keys)], 1)
        return info


@dataclass
class StreamTimes:
    """When one engine request's tokens came (time.monotonic() seconds), for its metrics and
    spans: a front-end choice's (http/state.py), a worker's Generate call's (grpc/server.py)."""

    submitted: float = 0.0   # sent to its engine
    first: float = 0.0       # its first token arrived (0: none did)
    last: float = 0.0        # its last token arrived
    tokens: int = 0

    def saw(self, tokens: int, now: float) -> None:
        """`tokens` more arrived at `now` (none: nothing changes)."""
        if tokens:
            self.first, self.last = self.first or now, now
            self.tokens += tokens


def _cumulative(counts: tuple[int, ...]) -> list[tuple[str, float]]:
    """Histogram buckets of acceptance lengths 1 .. k + 1 from counts[a] of rows that
    accepted a drafts (length a + 1), cumulative, with +Inf."""
    totals = itertools.accumulate(counts)
    return [(str(a + 1), float(t)) for a, t in enumerate(totals)] + [("+Inf", float(sum(counts)))]


class Metrics:
    def __init__(self, engine_sources: Callable[[], Iterable[EngineSource]] = lambda: ()):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def per_model(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"xlaserve_{name}", doc, [MODEL], buckets=buckets, registry=r)

        self.ttft = per_model("time_to_first_token_seconds",
                              "Time from arrival to the first token", _LATENCY)
        self.itl = per_model("inter_token_latency_seconds",
                             "Time between consecutive output events of a request", _ITL)
        self.tpot = per_model("request_time_per_output_token_seconds",
                              "Per choice: (last token - first token) / (tokens - 1)", _ITL)
        self.e2e = per_model("e2e_request_latency_seconds",
                             "Time from arrival to the last token", _LATENCY)
        self.queue_time = per_model("request_queue_time_seconds",
                                    "Time spent in the admission queue", _LATENCY)
        self.prefill_time = per_model("request_prefill_time_seconds", "Per choice: sent to the "
                                      "engine to its first token (the engine's wait for a batch "
                                      "row included)", _LATENCY)
        self.decode_time = per_model("request_decode_time_seconds",
                                     "Per choice: first token to last token", _LATENCY)
        self.inference_time = per_model("request_inference_time_seconds",
                                        "Per choice: sent to the engine to its last token",
                                        _LATENCY)
        self.request_prompt_tokens = per_model("request_prompt_tokens",
                                               "Prompt tokens of a request", _TOKENS)
        self.request_generation_tokens = per_model(
            "request_generation_tokens", "Tokens a request generated (all its choices)", _TOKENS)
        self.max_tokens_param = per_model("request_params_max_tokens",
                                          "The max_tokens a request ran with", _TOKENS)
        self.n_param = per_model("request_params_n", "The n of a request", _N)
        self.requests = Counter("xlaserve_request_success", "Finished engine requests (choices)"
                                ", by finish reason", [MODEL, "finished_reason"], registry=r)
        self.http = Counter("xlaserve_http_responses", "HTTP responses by status",
                            ["endpoint", "status"], registry=r)
        self.rejections = Counter("xlaserve_rejections", "Requests refused, by reason",
                                  ["reason"], registry=r)
        self.prompt_tokens = Counter("xlaserve_prompt_tokens", "Prompt tokens processed",
                                     [MODEL, "tenant"], registry=r)
        self.generation_tokens = Counter("xlaserve_generation_tokens", "Tokens generated",
                                         [MODEL, "tenant"], registry=r)
        self.admission_running = Gauge("xlaserve_admission_running",
                                       "Requests admitted to the engines", [MODEL], registry=r)
        self.admission_waiting = Gauge("xlaserve_admission_waiting",
                                       "Requests in the admission queue", [MODEL], registry=r)
        self.kv_transfer_seconds = per_model("kv_transfer_seconds", "Prefill/decode split: "
                                             "fetching one request's prompt KV from its "
                                             "prefill worker", _LATENCY)
        self.kv_transfer_bytes = Counter("xlaserve_kv_transfer_bytes", "Prefill/decode "
                                         "split: prompt KV bytes fetched", [MODEL], registry=r)
        r.register(_EngineCollector(engine_sources))

    def observe_choice(self, model: str, t: StreamTimes) -> None:
        """The per-choice stage times of one finished engine request that produced a token."""
        if not t.first:
            return
        self.prefill_time.labels(model).observe(t.first - t.submitted)
        self.decode_time.labels(model).observe(t.last - t.first)
        self.inference_time.labels(model).observe(t.last - t.submitted)
        if t.tokens > 1:
            self.tpot.labels(model).observe((t.last - t.first) / (t.tokens - 1))

    def observe_request(self, model: str, prompt_tokens: int, generation_tokens: int,
                        max_tokens: int, n: int) -> None:
        self.request_prompt_tokens.labels(model).observe(prompt_tokens)
        self.request_generation_tokens.labels(model).observe(generation_tokens)
        self.max_tokens_param.labels(model).observe(max_tokens)
        self.n_param.labels(model).observe(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
