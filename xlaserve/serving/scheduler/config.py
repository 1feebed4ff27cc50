"""The scheduler's knobs: one frozen dataclass, validated on construction.  Its defaults are
the served engine's (EngineConfig composes it: serving/engine/config.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_blocks: int = 2048           # KV pool size, including the null block 0
    block_size: int = 16                # tokens per KV block
    max_num_seqs: int = 32              # running sequences at most (decode batch rows)
    max_num_batched_tokens: int = 1024  # token budget per step, decodes and chunks together
    max_prefill_chunk: int = 512        # most tokens one sequence gets in one step
    max_model_len: int = 2048           # positions per sequence, prompt + output
    aging_seconds: float = 30.0         # each this long spent since arrival = one tier up
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        def bad(why: str) -> None:
            raise ValueError(f"SchedulerConfig: {why}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_prefill_chunk", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                bad(f"{name}={value!r} must be an integer >= 1")
        if not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2:
            bad(f"num_kv_blocks={self.num_kv_blocks!r} must be an integer >= 2 "
                "(block 0 is the null block)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            bad(f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs="
                f"{self.max_num_seqs}: every running sequence must fit one decode token a step")
        if math.isnan(self.aging_seconds) or self.aging_seconds <= 0:
            bad(f"aging_seconds={self.aging_seconds!r} must be > 0 (math.inf: no aging)")

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width the runner compiles for."""
        return -(-self.max_model_len // self.block_size)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_kv_blocks - 1
