"""One streamed request to an OpenAI-compatible server, timed chunk by chunk (httpx, SSE read
directly, no `openai` package).

    POST {base}/completions       {"model", "prompt", "max_tokens", "stream": true,
    POST {base}/chat/completions   "messages" instead of "prompt", "stream_options": ...}
    <- data: {"choices": [{"text": "..."}]}  or  [{"delta": {"content": "..."}}]   per token
    <- data: {"choices": [], "usage": {"completion_tokens": n, ...}}   with include_usage
    <- data: [DONE]

A chunk is a token arrival when it carries text (chat's opening `{"role": "assistant",
"content": ""}` and empty finish chunks are not).  TTFT is the first arrival after sending, ITL
every gap between arrivals, latency the end of the stream.  Output tokens are the server's
`usage.completion_tokens` when it sends usage, else the number of text chunks (one per token on
servers that stream token by token; fewer where a server merges tokens or holds back partial
UTF-8).  Nothing is raised: every outcome is a `RequestRecord` with a status.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

ENDPOINT_KINDS = ("completions", "chat")
OK = "ok"


@dataclass(frozen=True)
class TextRequest:
    request_id: str
    prompt: str
    max_tokens: int
    prompt_tokens: int | None = None   # its length where the dataset knows it (vLLM's prompt_len)


@dataclass(frozen=True)
class Endpoint:
    """Where and how requests are sent."""

    base_url: str                   # e.g. http://127.0.0.1:8000/v1
    model: str
    kind: str = "completions"       # or "chat"
    api_key: str | None = None
    include_usage: bool = True      # ask for stream_options.include_usage
    timeout_s: float = 120.0        # whole request, first byte to [DONE]
    ignore_eos: bool = False        # send ignore_eos (vLLM's and llama.cpp's extension):
                                    # every request generates exactly max_tokens

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.base_url!r}: expected http(s)://host:port/v1")
        if self.kind not in ENDPOINT_KINDS:
            raise ValueError(f"--endpoint {self.kind!r}: choose from {', '.join(ENDPOINT_KINDS)}")
        if not self.model:
            raise ValueError("--model: the served model's name is required")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout {self.timeout_s!r} must be > 0")

    @property
    def url(self) -> str:
        path = "/chat/completions" if self.kind == "chat" else "/completions"
        return self.base_url.rstrip("/") + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: TextRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.max_tokens,
                                "stream": True}
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    def describe(self) -> dict[str, Any]:
        """For reports: everything but the API key."""
        return {"url": self.base_url, "model": self.model, "kind": self.kind,
                "include_usage": self.include_usage, "timeout_s": self.timeout_s,
                "ignore_eos": self.ignore_eos,
                "api_key": "set" if self.api_key else None}


@dataclass
class RequestRecord:
    request_id: str
    status: str                      # "ok" | "http_<code>" | "timeout" | "connect_error" |
                                     # "transport_error" | "stream_error"
    scheduled_s: float               # its Poisson arrival, seconds since its rate's run began
    sent_s: float                    # when it was sent (later by the client's own lag)
    ttft_s: float | None = None      # first text chunk, seconds after sending
    latency_s: float | None = None   # end of stream, seconds after sending (ok requests)
    itl_s: list[float] = field(default_factory=list)   # gaps between successive text chunks
    output_tokens: int = 0
    text_chunks: int = 0
    prompt_tokens: int | None = None  # from usage
    usage_reported: bool = False
    text: str = ""                   # the streamed text (vLLM's generated_text)
    error: str | None = None         # the server's message or the exception, for failures

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (latency - TTFT) / (tokens - 1)."""
        if not self.ok or self.ttft_s is None or self.latency_s is None \
                or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


def _chunk_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return str((c["delta"] or {}).get("content") or "")
    return str(c.get("text") or "")


async def _stream(client: httpx.AsyncClient, endpoint: Endpoint, req: TextRequest,
                  sent: float, record: RequestRecord) -> None:
    """Fills `record` from one streamed response; status stays "stream_error" unless the
    stream ends with [DONE]."""
    async with client.stream("POST", endpoint.url, json=endpoint.body(req),
                             headers=endpoint.headers) as r:
        if r.status_code != 200:
            record.status = f"http_{r.status_code}"
            record.error = _error_message(await r.aread())
            return
        last: float | None = None
        async for line in r.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue                      # blank separators, comments, event: lines
            data = line[5:].strip()
            if data == "[DONE]":
                record.latency_s = now - sent
                record.status = OK
                break
            try:
                event = json.loads(data)
            except ValueError:
                record.error = f"not JSON: {data[:120]!r}"
                return
            if "error" in event:
                record.error = _error_message(data.encode())
                return
            usage = event.get("usage")
            if usage:
                record.usage_reported = True
                record.output_tokens = int(usage.get("completion_tokens", 0))
                record.prompt_tokens = usage.get("prompt_tokens")
            if piece := _chunk_text(event):
                record.text += piece
                if last is None:
                    record.ttft_s = now - sent
                else:
                    record.itl_s.append(now - last)
                last = now
                record.text_chunks += 1
        else:
            record.error = "the stream ended without [DONE]"
            return
    if not record.usage_reported:
        record.output_tokens = record.text_chunks


async def send(client: httpx.AsyncClient, endpoint: Endpoint, req: TextRequest,
               t0: float, scheduled_s: float = 0.0) -> RequestRecord:
    """Streams `req` now; `t0` is its rate run's start (perf_counter seconds)."""
    sent = time.perf_counter()
    record = RequestRecord(req.request_id, "stream_error", scheduled_s, sent - t0)
    try:
        async with asyncio.timeout(endpoint.timeout_s):
            await _stream(client, endpoint, req, sent, record)
    except (TimeoutError, httpx.TimeoutException):
        record.status, record.error = "timeout", f"not done after {endpoint.timeout_s:g} s"
    except httpx.ConnectError as e:
        record.status, record.error = "connect_error", repr(e)
    except httpx.TransportError as e:     # the connection broke mid-request
        record.status, record.error = "transport_error", repr(e)
    if not record.ok:
        record.latency_s = None
    return record
