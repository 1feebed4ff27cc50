"""OpenTelemetry spans (serving/telemetry.py) recorded by the SDK's in-memory exporter: one
trace per request under the client's traceparent, with gateway, router, admission and one
engine span per choice (prefill and decode under it, timed by the fake engine's delays) as
children; a request without a traceparent starts a trace whose ids the response's traceparent
names; a gRPC replica's worker span joins the same trace under the engine span; a refused
request's spans say why; tracing is off (a no-op tracer) without an endpoint."""

from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.serving.fake_engine import FakeEngine
from tests.serving.grpc.grpc_worker import Worker
from tests.serving.live_server import make_server, tokenizer, wait_for  # noqa: F401
from xlaserve.serving.grpc.client import RemoteEngine
from xlaserve.serving.server_config import ServedModel, ServerConfig, TracingConfig
from xlaserve.serving.telemetry import Telemetry

PREFILL, TOKEN = 0.06, 0.01          # the fake engine's delays, seconds
TRACE_ID, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"


def recorder() -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Telemetry(provider), exporter


def tree(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    """span name -> its spans; asserts they all share one trace."""
    assert len({s.context.trace_id for s in spans}) == 1, [s.name for s in spans]
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def seconds(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


def test_one_trace_per_request_under_the_clients_traceparent(make_server):  # noqa: F811
    srv = make_server(token_delay=TOKEN, prefill_delay=PREFILL)
    srv.state.telemetry, exporter = recorder()
    start = time.monotonic()
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                   json={"model": "fake", "n": 2, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "one two three"}]})
    wall = time.monotonic() - start
    assert r.status_code == 200 and r.headers["traceparent"] == TRACEPARENT
    assert wait_for(lambda: any(s.name.startswith("POST") for s in exporter.get_finished_spans()))
    by = tree(exporter.get_finished_spans())
    [root] = by["POST /v1/chat/completions"]
    assert format(root.context.trace_id, "032x") == TRACE_ID      # the client's trace
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT
    assert root.parent.is_remote and root.kind == SpanKind.SERVER
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.usage.output_tokens"] == 8
    rid = r.headers["x-request-id"]
    assert root.attributes["xlaserve.request_id"] == rid
    for stage in ("gateway", "router", "admission"):
        [s] = by[stage]
        assert parent_of(s) == root.context.span_id, stage
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time
    assert by["router"][0].attributes["xlaserve.model"] == "fake@1"
    assert by["admission"][0].attributes["xlaserve.queue_time_s"] >= 0
    assert by["gateway"][0].end_time <= by["router"][0].start_time \
        <= by["router"][0].end_time <= by["admission"][0].start_time
    engines = by["engine"]
    assert sorted(e.attributes["xlaserve.engine_request_id"] for e in engines) == \
        [f"{rid}-0", f"{rid}-1"]
    for e in engines:
        assert parent_of(e) == root.context.span_id
        assert e.attributes["xlaserve.replica"] == "fake@1/0"
        assert e.attributes["xlaserve.finish_reason"] == "length"
        assert e.attributes["gen_ai.usage.output_tokens"] == 4
        [first] = [ev for ev in e.events if ev.name == "first_token"]
        kids = {s.name: s for s in by["prefill"] + by["decode"]
                if parent_of(s) == e.context.span_id}
        assert set(kids) == {"prefill", "decode"}
        assert kids["prefill"].end_time == first.timestamp == kids["decode"].start_time
        # as long as the fake engine's delays at least, and within the request as the client
        # timed it (how much longer a loaded box makes them is not the spans' claim)
        assert PREFILL <= seconds(kids["prefill"])
        assert 3 * TOKEN * 0.9 <= seconds(kids["decode"])
        assert seconds(kids["prefill"]) + seconds(kids["decode"]) <= wall
        assert e.start_time == kids["prefill"].start_time
        assert e.end_time == kids["decode"].end_time
    assert len(exporter.get_finished_spans()) == 1 + 3 + 2 * 3


def test_a_trace_begun_here_and_a_refused_request(make_server):  # noqa: F811
    srv = make_server(token_delay=TOKEN)
    srv.state.telemetry, exporter = recorder()
    r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "hi there",
                                                      "max_tokens": 2})
    assert r.status_code == 200
    assert wait_for(lambda: any(s.name.startswith("POST") for s in exporter.get_finished_spans()))
    [root] = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
    assert root.parent is None                       # no traceparent came: a new trace ...
    _, tid, sid, _ = r.headers["traceparent"].split("-")
    assert (tid, sid) == (format(root.context.trace_id, "032x"),
                          format(root.context.span_id, "016x"))   # ... the response names
    exporter.clear()
    bad = httpx.post(srv.url + "/v1/completions", headers={"traceparent": TRACEPARENT},
                     json={"model": "fake", "prompt": "hi", "max_tokens": 2, "top_p": 7})
    assert bad.status_code == 400
    by = tree(exporter.get_finished_spans())
    [root] = by["POST /v1/completions"]
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes["http.response.status_code"] == 400
    [gateway] = by["gateway"]                         # parse failed: no router, no engine
    assert gateway.status.status_code == StatusCode.ERROR and "router" not in by
    assert any(ev.name == "exception" for ev in gateway.events)


def test_the_grpc_hop_joins_the_trace(make_server, tokenizer):  # noqa: F811
    worker_tel, worker_spans = recorder()
    with Worker(FakeEngine(tokenizer, "fake", token_delay=TOKEN, prefill_delay=PREFILL),
                telemetry=worker_tel) as w:
        remote = RemoteEngine(w.target, "fake", tokenizer, poll_interval=0.1)
        cfg = ServerConfig(models=(ServedModel("fake", replicas=(f"grpc://{w.target}",)),))
        srv = make_server(cfg, {"fake@1": [remote]})
        srv.state.telemetry, front_spans = recorder()
        assert wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200)
        r = httpx.post(srv.url + "/v1/completions", headers={"traceparent": TRACEPARENT},
                       json={"model": "fake", "prompt": "one two three", "max_tokens": 3})
        assert r.status_code == 200
        assert wait_for(lambda: len(worker_spans.get_finished_spans()) == 3)
        assert wait_for(lambda: any(s.name.startswith("POST")
                                    for s in front_spans.get_finished_spans()))
    front = tree(front_spans.get_finished_spans())
    worker = tree(worker_spans.get_finished_spans())
    [engine] = front["engine"]
    [hop] = worker["xlaserve.v1.Generation/Generate"]
    assert hop.context.trace_id == engine.context.trace_id == int(TRACE_ID, 16)
    assert parent_of(hop) == engine.context.span_id and hop.kind == SpanKind.SERVER
    assert hop.attributes["rpc.system"] == "grpc" and hop.attributes["rpc.method"] == "Generate"
    assert hop.attributes["xlaserve.finish_reason"] == "length"
    assert hop.attributes["gen_ai.usage.output_tokens"] == 3
    assert {s.name for s in worker_spans.get_finished_spans()
            if parent_of(s) == hop.context.span_id} == {"prefill", "decode"}
    assert engine.start_time <= hop.start_time and hop.end_time <= engine.end_time + 10**8


def test_off_without_an_endpoint() -> None:
    tel = Telemetry.from_config(TracingConfig())
    assert tel.provider is None and not tel.tracer.start_span("x").is_recording()
    with pytest.raises(ValueError, match="'collector:4318'"):
        TracingConfig(otlp_endpoint="collector:4318")
