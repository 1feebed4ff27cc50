"""Count XLA compilations (fresh compiles and persistent-cache loads) while a block runs.

    with CompileCounter() as c:
        ...serve a workload...
    assert c.count == 0
"""

from __future__ import annotations

from typing import Any

import jax.monitoring as monitoring

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    def __init__(self) -> None:
        self.compiles = 0     # executables built by the backend
        self.cache_loads = 0  # executables loaded from the persistent compilation cache

    @property
    def count(self) -> int:
        return self.compiles + self.cache_loads

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event == BACKEND_COMPILE:
            self.compiles += 1

    def _on_event(self, event: str, **_: Any) -> None:
        if event == CACHE_HIT:
            self.cache_loads += 1

    def __enter__(self) -> "CompileCounter":
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)
