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
    """jax times a persistent-cache load as a backend compile too (its cache_hits event comes
    first, then backend_compile_duration): such a duration is counted as the load it is."""

    def __init__(self) -> None:
        self.compiles = 0     # executables built by the backend
        self.cache_loads = 0  # executables loaded from the persistent compilation cache
        self._loads_untimed = 0   # cache hits whose backend_compile_duration is still to come

    @property
    def count(self) -> int:
        return self.compiles + self.cache_loads

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event == BACKEND_COMPILE:
            if self._loads_untimed:
                self._loads_untimed -= 1
            else:
                self.compiles += 1

    def _on_event(self, event: str, **_: Any) -> None:
        if event == CACHE_HIT:
            self.cache_loads += 1
            self._loads_untimed += 1

    def __enter__(self) -> "CompileCounter":
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)
