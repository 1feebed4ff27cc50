"""An engine factory for the warm-up failure test: the real engines of `served`, whose runner's
warm-up raises (as a compile that runs out of memory, or a kernel that cannot build, would)."""

from __future__ import annotations

from typing import Any

from xlaserve.serving.engine.threaded_engine import ThreadedEngine
from xlaserve.serving.engine.factory import threaded_engines


def build(served: Any) -> list[ThreadedEngine]:
    engines = threaded_engines(served)
    for e in engines:
        def warmup(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("injected warm-up failure")
        e.engine.runner.warmup = warmup
    return engines
