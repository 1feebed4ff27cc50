"""A KV slot: `block_id * block_size + offset`, one token's place in a layer's paged cache (the
forward writes each token's key and value at its slot, `AttentionMetadata.slot_mapping`).

`slot_mapping` is the one function that turns positions into slots: the scheduler's plan rows
(serving/scheduler/step_plan.py) and hand-made batches (batch_metadata.py) both call it.  Plain
Python, no jax or numpy: the host-only scheduler imports it.
"""

from __future__ import annotations

from collections.abc import Sequence


def slot_mapping(block_table: Sequence[int], start: int, n: int,
                 block_size: int) -> tuple[int, ...]:
    """The cache slots (block_id * block_size + offset) of positions start .. start + n - 1."""
    return tuple(int(block_table[p // block_size]) * block_size + p % block_size
                 for p in range(start, start + n))
