"""A runner call's two stages: `Forwarded` (its forward launched, `ModelRunner.forward`) and
`CallResult` (its sampler launched too, `ModelRunner.sample`): device arrays, read by the caller
when it needs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from xlaserve.serving.runner.host_step import HostStep
from xlaserve.serving.runner.sampling import SampleOutput


@dataclass(frozen=True)
class Forwarded:
    """A call between `ModelRunner.forward` and `sample`: its host inputs and sample rows
    (see CallResult), and, once its forward is launched, the packed rows as the forward took
    them and its logits [R, V] (None on a multi-host mesh until `sample` sends the step)."""

    host: HostStep
    sample_rows: tuple[tuple[int, ...], ...]
    started: float                 # time.perf_counter() of `forward`
    rows: Any = None
    logits: jax.Array | None = None


@dataclass(frozen=True)
class CallResult:
    """Device outputs of one call; `rows` of them are real, the rest padding.  Plan row i's
    samples are at `sample_rows[i]`, in position order: (i,) for a plain row, the draft
    positions' extra rows then i for a verify row."""

    rows: int
    out: SampleOutput
    bucket: tuple[int, int, int]   # (rows, tokens, width) of the compiled call
    sample_rows: tuple[tuple[int, ...], ...] = ()

    def ready(self) -> bool:
        """Has the device finished the call (fetch would not block)?  A deleted result (lost
        on device) counts as ready: fetch raises at once (and is_ready() on it would crash)."""
        tokens = self.out.tokens
        return tokens.is_deleted() or tokens.is_ready()

    def fetch(self) -> dict[str, np.ndarray]:
        host = jax.device_get(self.out)   # replicated: every process can read it
        return {name: np.asarray(v)[: self.rows] for name, v in host._asdict().items()}
