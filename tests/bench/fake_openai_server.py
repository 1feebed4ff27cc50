"""A stand-in OpenAI-compatible server that is not xlaserve (stdlib http.server, one thread per
request), for `bench online`'s server-agnostic paths: GET /v1/models, and streamed POST
/v1/completions and /v1/chat/completions that answer exactly `max_tokens` tokens ("w0 w1 ..."),
the first after `first_delay` seconds, then one every `token_delay`, with a usage chunk when
`stream_options.include_usage` asks for one.  Every request body is kept in `bodies`."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


class _Listener(ThreadingHTTPServer):
    request_queue_size = 128   # the default backlog (5) drops bursts of connects: 1 s retries
    daemon_threads = True


class FakeOpenAIServer:
    def __init__(self, model: str = "fake-llm", first_delay: float = 0.05,
                 token_delay: float = 0.02):
        self.model, self.first_delay, self.token_delay = model, first_delay, token_delay
        self.bodies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._http = _Listener(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()

    def _chunk(self, chat: bool, text: str) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0,
                                                                         "text": text}
        return {"object": "chat.completion.chunk" if chat else "text_completion",
                "model": self.model, "choices": [choice]}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"   # the stream ends when the connection closes

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    self.send_error(404)
                    return
                self._send(200, {"object": "list", "data": [{"id": server.model}]})

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                chat = self.path == "/v1/chat/completions"
                if not chat and self.path != "/v1/completions":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                time.sleep(server.first_delay)
                n = int(body["max_tokens"])
                for i in range(n):
                    if i:
                        time.sleep(server.token_delay)
                    self._event(server._chunk(chat, f" w{i}"))
                if (body.get("stream_options") or {}).get("include_usage"):
                    self._event({"choices": [], "usage": {
                        "prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _event(self, event: dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()

        return Handler
