"""The `make` fixture: every scheduler a test builds gets `check_integrity()` at teardown, on
top of the checks the step drivers in scheduler_helpers.py run after every step."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from xlaserve.serving.scheduler import Scheduler, SchedulerConfig


@pytest.fixture
def make() -> Iterator[Callable[..., Scheduler]]:
    made: list[Scheduler] = []

    def build(**overrides: object) -> Scheduler:
        base: dict[str, object] = {"num_kv_blocks": 33, "block_size": 4, "max_num_seqs": 8,
                                   "max_num_batched_tokens": 64, "max_prefill_chunk": 64,
                                   "max_model_len": 256, "aging_seconds": float("inf")}
        base.update(overrides)
        s = Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]
        made.append(s)
        return s

    yield build
    for s in made:
        s.check_integrity()
