"""`[tracing] otlp_endpoint` end to end: the server's spans leave over OTLP/HTTP (the real
exporter, protobuf over HTTP POST) to a receiver this test starts, which decodes them as an
OpenTelemetry collector would."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.serving.live_server import make_server, tokenizer  # noqa: F401
from xlaserve.serving.server_config import ServedModel, ServerConfig, TracingConfig

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Receiver(BaseHTTPRequestHandler):
    """POST /v1/traces: one ExportTraceServiceRequest per call, kept in `server.requests`."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append((self.path, self.headers["Content-Type"],  # type: ignore
                                     ExportTraceServiceRequest.FromString(body)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_spans_reach_an_otlp_http_receiver(make_server):  # noqa: F811
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    receiver.requests = []   # type: ignore[attr-defined]
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
        srv = make_server(ServerConfig(models=(ServedModel("fake"),), tracing=TracingConfig(
            otlp_endpoint=endpoint, service_name="otlp-test")))
        r = httpx.post(srv.url + "/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                       json={"model": "fake", "max_tokens": 3,
                             "messages": [{"role": "user", "content": "one two"}]})
        assert r.status_code == 200
        assert srv.state.telemetry.provider.force_flush(10_000)
    finally:
        receiver.shutdown()
    requests = receiver.requests   # type: ignore[attr-defined]
    assert requests and {(p, t) for p, t, _ in requests} == {
        ("/v1/traces", "application/x-protobuf")}
    spans, services = [], set()
    for _, _, export in requests:
        for rs in export.resource_spans:
            services |= {a.value.string_value for a in rs.resource.attributes
                         if a.key == "service.name"}
            spans += [s for ss in rs.scope_spans for s in ss.spans]
    assert services == {"otlp-test"}
    assert {s.trace_id.hex() for s in spans} == {TRACE_ID}
    names = {s.name for s in spans}
    assert {"POST /v1/chat/completions", "gateway", "router", "admission", "engine"} <= names
    assert all(s.end_time_unix_nano >= s.start_time_unix_nano > 0 for s in spans)
