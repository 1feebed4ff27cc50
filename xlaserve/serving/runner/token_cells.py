"""Which sequence's last sampled token sits in which cell of the runner's device token-cell
array (`ModelRunner.token_cells`, [max_num_seqs + 1] int32): a row whose next input is still on
device (PENDING_TOKEN) reads it from its sequence's cell.  Cell 0 takes the writes of rows that
do not sample.  Host bookkeeping, no jax."""

from __future__ import annotations


class TokenCells:
    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"token cells: count {count} must be >= 1")
        self.count = count
        self._of: dict[str, int] = {}
        self._free = list(range(count, 0, -1))   # cells 1..count, the lowest handed out first

    def cell(self, owner: str) -> int:
        """`owner`'s cell, in [1, count]: the one it holds, else a free one."""
        if owner not in self._of:
            if not self._free:
                raise RuntimeError(f"token cells: all {self.count} are held (by "
                                   f"{sorted(self._of)[:4]}...); {owner!r} gets none")
            self._of[owner] = self._free.pop()
        return self._of[owner]

    def release(self, owner: str) -> None:
        """Free `owner`'s cell (a no-op if it holds none)."""
        cell = self._of.pop(owner, None)
        if cell is not None:
            self._free.append(cell)

    def release_all(self) -> None:
        self._of.clear()
        self._free = list(range(self.count, 0, -1))

    def __len__(self) -> int:
        """Cells held."""
        return len(self._of)
