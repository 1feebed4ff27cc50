"""What one HTTP app serves with: config, router (model groups with their admission queues and
replicas), gateway parts and metrics, and the generations running (http/generation.py).

Shutdown (`ServingState.drain`): stop admitting (new requests and /ready answer 503), let the
running generations finish for up to `server.drain_timeout_s`, then stop the rest through their
engines; each of those ends with an explicit "server shutting down" error (a 503 body, or an
SSE error event before [DONE]) instead of a cut connection.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING, Any

from xlaserve.serving.gateway.audit import AuditLog
from xlaserve.serving.gateway.auth import Authenticator
from xlaserve.serving.gateway.ratelimit import RateLimiter
from xlaserve.serving.metrics import EngineSource, Metrics
from xlaserve.serving.router import Router
from xlaserve.serving.server_config import ServerConfig
from xlaserve.serving.telemetry import Telemetry

if TYPE_CHECKING:   # a Generation registers itself here (http/generation.py)
    from xlaserve.serving.http.generation import Generation


class ServingState:
    def __init__(self, config: ServerConfig, router: Router):
        self.config = config
        self.router = router
        self.auth = Authenticator(config.auth)
        self.limiter = RateLimiter(config.tier_limits)
        self.audit = AuditLog(config.audit.path, config.audit.include_prompts) \
            if config.audit.path else None
        self.metrics = Metrics(self._engine_sources)
        self.telemetry = Telemetry.from_config(config.tracing)
        self.engine_ids: set[str] = set()          # engine request ids in flight
        self.generations: set[Generation] = set()  # not closed yet
        self.draining = False
        self._background: set[asyncio.Task[Any]] = set()

    def _engine_sources(self) -> list[EngineSource]:
        return [(g.id, r.name, r.engine) for g in self.router.groups for r in g.replicas]

    @property
    def ready(self) -> bool:
        return (not self.draining and bool(self.router.groups)
                and all(g.ready for g in self.router.groups))

    async def drain(self, timeout_s: float, settle_s: float = 5.0) -> int:
        """Stop admitting; wait up to `timeout_s` for the running generations, then stop the
        rest (their responses end with a "server shutting down" error) and wait up to
        `settle_s` for them to close.  Returns how many had to be stopped."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.generations and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stopped = list(self.generations)
        for gen in stopped:
            await gen.stop("server shutting down")
        deadline = time.monotonic() + settle_s
        while self.generations and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return len(stopped)

    def update_admission_gauges(self) -> None:
        for g in self.router.groups:
            self.metrics.admission_running.labels(g.id).set(g.admission.running)
            self.metrics.admission_waiting.labels(g.id).set(g.admission.waiting)

    def new_engine_id(self, base: str) -> str:
        rid = base if base not in self.engine_ids else f"{base}~{secrets.token_hex(3)}"
        self.engine_ids.add(rid)
        return rid

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run `coro` to completion even if the caller is cancelled (cleanup paths)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
