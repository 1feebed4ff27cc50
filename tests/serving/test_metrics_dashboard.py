"""/metrics speaks vLLM's names (serving/metrics.py) and serves the Grafana dashboard
(deploy/grafana/xlaserve.json): after one real request through a real engine (the tiny random
Llama on the shared warmed-up runner) and one refused request, every metric the dashboard's
queries name is in the scrape, the request's histograms hold what it did, and the names are
vLLM's v1 names under `xlaserve_`."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT
from tests.serving.engine.conftest import new_tiny_engine, warm_tiny  # noqa: F401 (fixture)
from tests.serving.live_server import LiveServer
from xlaserve.serving.engine.threaded_engine import ThreadedEngine
from xlaserve.serving.http.server import build_state
from xlaserve.serving.server_config import ServedModel, ServerConfig

DASHBOARD = ROOT / "deploy" / "grafana" / "xlaserve.json"
# vLLM v1's families whose meaning ours share (vllm/v1/metrics/loggers.py), as vllm:NAME
VLLM_NAMES = (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
    "generation_tokens", "request_success", "request_prompt_tokens",
    "request_generation_tokens", "request_params_max_tokens", "request_params_n",
    "time_to_first_token_seconds", "inter_token_latency_seconds",
    "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_inference_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds")


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """sample name -> {sorted labels: value}."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for k, v in samples[name].items() if set(labels.items()) <= set(k))


def test_every_dashboard_metric_is_scraped_after_a_real_request(warm_tiny):  # noqa: F811
    engine = ThreadedEngine(new_tiny_engine(warm_tiny), "tiny")
    engine.launch(warmup=False)     # the shared runner is compiled already
    config = ServerConfig(models=(ServedModel("tiny"),))
    srv = LiveServer(build_state(config, {"tiny@1": [engine]})).start()
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "one two three four five", "max_tokens": 6,
            "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        bad = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                          "max_tokens": -1})
        assert bad.status_code == 400
        samples = scrape(srv.url)
    finally:
        srv.stop()

    used = {m for e in dashboard_queries() for m in re.findall(r"\bxlaserve_[a-z0-9_]+", e)}
    assert len(used) >= 20, used
    missing = sorted(used - set(samples))
    assert not missing, f"the dashboard queries metrics /metrics lacks: {missing}"
    for name in VLLM_NAMES:   # every vLLM family we mirror is there, under its vLLM name
        assert any(s.startswith(f"xlaserve_{name}") for s in samples), name

    prompt = r.json()["usage"]["prompt_tokens"]
    model = {"model_name": "tiny@1"}
    assert value(samples, "xlaserve_request_success_total", finished_reason="length",
                 **model) == 1
    assert value(samples, "xlaserve_generation_tokens_total", **model) == 6
    assert value(samples, "xlaserve_request_generation_tokens_sum", **model) == 6
    assert value(samples, "xlaserve_request_prompt_tokens_sum", **model) == prompt
    assert value(samples, "xlaserve_request_params_max_tokens_sum", **model) == 6
    assert value(samples, "xlaserve_request_params_n_sum", **model) == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_time_per_output_token_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds"):
        assert value(samples, f"xlaserve_{h}_count", **model) == 1, h
    assert value(samples, "xlaserve_inter_token_latency_seconds_count", **model) == 5
    # the stages add up: prefill + decode == inference <= e2e; TTFT >= prefill
    stage = {h: value(samples, f"xlaserve_request_{h}_time_seconds_sum", **model)
             for h in ("prefill", "decode", "inference")}
    assert abs(stage["prefill"] + stage["decode"] - stage["inference"]) < 1e-6
    assert stage["inference"] <= value(samples, "xlaserve_e2e_request_latency_seconds_sum",
                                       **model)
    assert value(samples, "xlaserve_time_to_first_token_seconds_sum", **model) \
        >= stage["prefill"]
    assert value(samples, "xlaserve_request_time_per_output_token_seconds_sum", **model) \
        == pytest.approx(stage["decode"] / 5)
    assert value(samples, "xlaserve_num_requests_running", engine="tiny@1/1", **model) == 0
    assert value(samples, "xlaserve_rejections_total", reason="invalid_request") == 1
