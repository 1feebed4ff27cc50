"""Live-server fixtures (imported by the conftests that use them): the real SmolLM2 tokenizer,
fake engines, and a real hypercorn server on 127.0.0.1 with a free port, run in a thread with
its own event loop."""

from __future__ import annotations

from tests.conftest import MODEL_DIR

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from tests.serving.fake_engine import FakeEngine
from hypercorn.asyncio import serve

from xlaserve.serving.http.app import create_app
from xlaserve.serving.http.server import build_state, drain_trigger, hypercorn_config
from xlaserve.serving.http.state import ServingState
from xlaserve.serving.server_config import ServedModel, ServerConfig
from xlaserve.serving.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    folder = Path(str(MODEL_DIR))
    if not (folder / "tokenizer.json").exists():
        pytest.fail(f"no converted model folder at {folder}: run `make model` (make test does)")
    return Tokenizer.load(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    def __init__(self, state: ServingState):
        self.state = state
        self.port = free_port()
        self.tls = bool(state.config.tls_cert)
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(create_app(self.state), hypercorn_config(self.state.config, self.port),
                        shutdown_trigger=drain_trigger(self.state, self._stop))
        asyncio.run(main())

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                verify = (ssl.create_default_context(cafile=self.state.config.tls_cert)
                          if self.tls else True)
                if httpx.get(self.url + "/health", timeout=1,
                             verify=verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def begin_stop(self) -> None:
        """What SIGTERM does: start the drain; `stop()` then waits for the server to end."""
        if self._loop and self._stop and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)

    def stop(self) -> None:
        self.begin_stop()
        self._thread.join(10 + self.state.config.drain_timeout_s)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def make_server(tokenizer: Tokenizer) -> Iterator[Callable[..., LiveServer]]:
    servers: list[LiveServer] = []

    def make(config: ServerConfig | None = None, engines: dict | None = None,
             **engine_kw: object) -> LiveServer:
        if config is None:
            config = ServerConfig(models=(ServedModel("fake"),))
        if engines is None:
            engines = {m.id: [FakeEngine(tokenizer, m.name, **engine_kw)]  # type: ignore[arg-type]
                       for m in config.models}
        srv = LiveServer(build_state(config, engines)).start()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()
