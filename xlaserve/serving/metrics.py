"""Prometheus metrics, one CollectorRegistry per app (never the global one), close to vLLM's
core set.  Request-path metrics are observed by the front end as events pass; engine state
(running, waiting, KV usage, prefix cache, preemptions) is read from `engine.stats()`, and the
step costs admission projects from (`engine.service_costs()`), at scrape time by a
collector, so it is never stale and costs nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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

# One entry per engine replica: (model id, replica name, engine).
EngineSource = tuple[str, str, AsyncEngine]


class _EngineCollector(Collector):
    def __init__(self, sources: Callable[[], Iterable[EngineSource]]):
        self._sources = sources

    def collect(self) -> Iterable[Metric]:
        labels = ["model", "replica"]
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
        keys = ("attention_backend", "platform", "dtype")
        info = GaugeMetricFamily("xlaserve_engine_info", "Kernels a local engine serves with "
                                 "(value 1)", labels=["model", "replica", *keys])
        for model, replica, engine in self._sources():
            kernels = getattr(engine, "kernels", None)
            if isinstance(kernels, dict):
                info.add_metric([model, replica, *(str(kernels.get(k, "")) for k in keys)], 1)
        return info


def _cumulative(counts: tuple[int, ...]) -> list[tuple[str, float]]:
    """Histogram buckets of acceptance lengths 1 .. k + 1 from counts[a] of rows that
    accepted a drafts (length a + 1), cumulative, with +Inf."""
    out, total = [], 0
    for a, n in enumerate(counts):
        total += n
        out.append((str(a + 1), float(total)))
    return out + [("+Inf", float(total))]


class Metrics:
    def __init__(self, engine_sources: Callable[[], Iterable[EngineSource]] = lambda: ()):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("xlaserve_time_to_first_token_seconds",
                              "Time from arrival to the first token", ["model"],
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("xlaserve_inter_token_latency_seconds",
                             "Time between consecutive output events of a request", ["model"],
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("xlaserve_e2e_request_latency_seconds",
                             "Time from arrival to the last token", ["model"],
                             buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("xlaserve_request_queue_time_seconds",
                                    "Time spent in the admission queue", ["model"],
                                    buckets=_LATENCY, registry=r)
        self.requests = Counter("xlaserve_requests", "Finished requests",
                                ["model", "finish_reason"], registry=r)
        self.http = Counter("xlaserve_http_responses", "HTTP responses by status",
                            ["endpoint", "status"], registry=r)
        self.rejections = Counter("xlaserve_rejections", "Requests refused, by reason",
                                  ["reason"], registry=r)
        self.prompt_tokens = Counter("xlaserve_prompt_tokens", "Prompt tokens processed",
                                     ["model", "tenant"], registry=r)
        self.generation_tokens = Counter("xlaserve_generation_tokens", "Tokens generated",
                                         ["model", "tenant"], registry=r)
        self.admission_running = Gauge("xlaserve_admission_running",
                                       "Requests admitted to the engines", ["model"], registry=r)
        self.admission_waiting = Gauge("xlaserve_admission_waiting",
                                       "Requests in the admission queue", ["model"], registry=r)
        r.register(_EngineCollector(engine_sources))

    def render(self) -> bytes:
        return generate_latest(self.registry)
