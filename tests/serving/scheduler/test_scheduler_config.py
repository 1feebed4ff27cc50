"""Config validation and add() rejections show the offending values."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from tests.serving.scheduler.scheduler_helpers import req

from xlaserve.serving.scheduler import Scheduler, SchedulerConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size=0 must be an integer >= 1"),
    ({"num_kv_blocks": 1}, "num_kv_blocks=1 must be an integer >= 2"),
    ({"max_num_seqs": 10, "max_num_batched_tokens": 8},
     "max_num_batched_tokens=8 < max_num_seqs=10"),
    ({"aging_seconds": 0.0}, "aging_seconds=0.0 must be > 0"),
    ({"aging_seconds": float("nan")}, "aging_seconds=nan must be > 0"),
    ({"max_model_len": 2.5}, "max_model_len=2.5 must be an integer"),
])
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_config_derived_values() -> None:
    c = SchedulerConfig(block_size=16, max_model_len=100, num_kv_blocks=10)
    assert (c.max_blocks_per_seq, c.num_usable_blocks) == (7, 9)


def test_add_rejections(make: Callable[..., Scheduler]) -> None:
    s = make(num_kv_blocks=5, max_model_len=64)     # 4 blocks of 4 = 16 slots
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        s.add(req("a", []))
    with pytest.raises(ValueError, match="negative token id -3"):
        s.add(req("a", [1, -3]))
    with pytest.raises(ValueError, match="prompt has 64 tokens, max_model_len=64"):
        s.add(req("a", 64))
    with pytest.raises(ValueError, match="up to 21 tokens need 5 KV blocks of 4, the pool has 4"):
        s.add(req("a", 20, max_tokens=1))
    s.add(req("a", 16, max_tokens=1))               # 16 positions computed: fits exactly
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        s.add(req("a", 3))
    assert s.num_waiting == 1
    s.abort("a")
