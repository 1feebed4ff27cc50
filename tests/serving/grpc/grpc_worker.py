"""A gRPC worker serving a FakeEngine in its own thread and event loop, on 127.0.0.1 with a
free port, with the credentials (none by default) and telemetry (none) it is given."""

from __future__ import annotations

import asyncio
import threading
from typing import Self

from tests.serving.fake_engine import FakeEngine
from xlaserve.serving.grpc.auth import WorkerAuth
from xlaserve.serving.grpc.server import start_grpc_server
from xlaserve.serving.telemetry import Telemetry


class Worker:
    def __init__(self, engine: FakeEngine, auth: WorkerAuth = WorkerAuth(),
                 telemetry: Telemetry | None = None):
        self.engine = engine
        self.auth = auth
        self.telemetry = telemetry
        self.port = 0
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server, self.port, watcher = await start_grpc_server({"fake": self.engine},
                                                             "127.0.0.1:0", self.auth,
                                                             self.telemetry)
        self._started.set()
        await self._stop.wait()
        watcher.cancel()
        await server.stop(0)

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
