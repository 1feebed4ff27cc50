"""The draft model's runner: a ModelRunner (same mesh, same bucket machinery, its own paged KV
cache) that also keeps, for calls with sampling rows, the distribution q each row's token was
drawn from.

    run(rows)      forward + sampler, as any runner (the drafts: greedy argmax, or a draw
                   keyed by the row's own salted seed)
                   temperature > 0 somewhere: last_probs = filtered_probs(logits) [R, V]
                   on device (distribution.py: the same cut the sampler drew with)

The probabilities are compiled once per row count, in warm-up with the rest.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from xlaserve.serving.runner.distribution import filtered_probs
from xlaserve.serving.runner.host_step import ROW_FIELDS, HostStep
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.runner.step_functions import sampling_arrays, unpack


def draft_probs_step(logits: jax.Array, rows: jax.Array) -> jax.Array:
    # logits: [R, V]; rows: [len(ROW_FIELDS), R] (HostStep.packed) -> [R, V] (no bias: drafts
    # take no penalties)
    return filtered_probs(logits, sampling_arrays(unpack(rows, ROW_FIELDS),
                                                  jnp.zeros_like(logits)))


class DraftRunner(ModelRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._jitted_probs = jax.jit(draft_probs_step, out_shardings=self.replicated)
        self._compiled_probs: dict[int, Any] = {}
        self.last_probs: jax.Array | None = None   # [R, V] of the last call, or None (greedy)

    def compile(self, shape: tuple[int, int, int]) -> Any:
        r = shape[0]
        if r not in self._compiled_probs:
            _, (logits, _, rows, *_) = self._abstract_args(*shape)   # the sampler's
            self._compiled_probs[r] = self._jitted_probs.lower(logits, rows).compile()
        return super().compile(shape)

    def _forwarded(self, host: HostStep, rows: jax.Array, logits: jax.Array) -> None:
        self.last_probs = (self._compiled_probs[host.shape[0]](logits, rows)
                           if (host.temperature > 0).any() else None)
