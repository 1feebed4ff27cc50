"""The gpu_check harness: one time budget for the whole run (`Clock`), each measurement
recorded as a result row, an error or a skip (`record`), median timings (`bench`) and the
device's copy bandwidth, the yardstick of the kernels' bytes/s."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Clock:
    """One deadline for the whole run."""

    deadline: float

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def record(rows: list[dict[str, Any]], tag: str, clock: Clock, row: dict[str, Any],
           fn: Callable[[], dict[str, Any]]) -> None:
    """Append `row` to `rows` with what `fn()` measured (and print it), with the error `fn`
    raised (a kernel that fails to build is a result, not a crash), or, past the time budget,
    marked skipped without running `fn`."""
    if clock.left() < 0:
        rows.append(dict(row, status="skipped: time budget"))
        return
    try:
        row.update(fn())
    except Exception as e:
        row["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
    print(f"[{tag}] {row}", flush=True)


def bench(fn: Callable[[], Any], *, repeats: int) -> float:
    """Median seconds of `fn()`, after two warm-up calls (compile + first run)."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of a device elementwise op that reads and writes `nbytes` each."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    add = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / bench(lambda: add(x), repeats=repeats)
