"""AttentionMetadata for batches made by hand (benchmarks, tests, the offline generator): one
row of tokens, or a decode batch of one token per row.  The serving path builds its batches in
serving/runner/host_step.py.  numpy only."""

from __future__ import annotations

import numpy as np

from xlaserve.models.kv_slots import slot_mapping
from xlaserve.models.llama import AttentionMetadata


def one_row_metadata(block_table: np.ndarray, start: int, num_tokens: int, pad_to: int,
                     block_size: int) -> tuple[np.ndarray, AttentionMetadata]:
    """positions [pad_to] and the metadata of a batch holding one row: `num_tokens` tokens
    from position `start` over `block_table` [W], then padding (numpy arrays)."""
    table = np.asarray(block_table, np.int32)
    pos = start + np.arange(pad_to, dtype=np.int32)
    real = np.arange(pad_to) < num_tokens
    slots = np.zeros(pad_to, np.int32)   # padding writes the null block's slot 0
    slots[:num_tokens] = slot_mapping(table, start, num_tokens, block_size)
    rows = np.where(real, 0, -1).astype(np.int32)
    return np.where(real, pos, 0).astype(np.int32), AttentionMetadata(table[None], rows, slots)


def decode_metadata(block_tables: np.ndarray, positions: np.ndarray,
                    block_size: int) -> AttentionMetadata:
    """The metadata of a decode batch: row r feeds one token, at positions[r] (numpy)."""
    tables = np.asarray(block_tables, np.int32)
    pos = np.asarray(positions, np.int32)
    rows = np.arange(len(pos), dtype=np.int32)
    slots = [slot_mapping(table, p, 1, block_size)[0] for table, p in zip(tables, pos.tolist())]
    return AttentionMetadata(tables, rows, np.asarray(slots, np.int32))
