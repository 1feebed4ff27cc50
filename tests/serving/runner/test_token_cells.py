"""The runner's token-cell bookkeeping: one cell per sequence in [1, count] (0 is the padding
rows'), kept until released, reused after, and a clear error when every cell is held.
Host-only: runs without jax (tests/test_jax_free.py)."""

from __future__ import annotations

import pytest

from xlaserve.serving.runner.token_cells import TokenCells


def test_a_sequence_keeps_its_cell_until_released() -> None:
    cells = TokenCells(3)
    a, b = cells.cell("a"), cells.cell("b")
    assert (a, b) == (1, 2) and cells.cell("a") == a and len(cells) == 2
    cells.release("a")
    cells.release("a")                     # twice: a no-op
    assert cells.cell("c") == a and len(cells) == 2
    assert {cells.cell("d"), b, a} == {1, 2, 3}


def test_full_cells_name_the_request_left_without_one() -> None:
    cells = TokenCells(1)
    cells.cell("a")
    with pytest.raises(RuntimeError, match="all 1 are held.*'b' gets none"):
        cells.cell("b")
    cells.release_all()
    assert cells.cell("b") == 1


def test_no_cells_is_refused() -> None:
    with pytest.raises(ValueError, match="count 0"):
        TokenCells(0)
