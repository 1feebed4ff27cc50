"""The bucket plan by hand: sizes from the limits, every shape of warm-up, the bucket a step
pads to, and the errors that name the bad value."""

from __future__ import annotations

import pytest

from xlaserve.serving.runner.buckets import BucketPlan, powers_of_two

PLAN = BucketPlan(row_sizes=(1, 2, 4), token_sizes=(8, 16), table_widths=(4, 8))


def test_powers_of_two_end_at_the_limit():
    assert powers_of_two(1, 32) == (1, 2, 4, 8, 16, 32)
    assert powers_of_two(16, 100) == (16, 32, 64, 100)
    assert powers_of_two(4, 4) == (4,)


def test_for_limits():
    p = BucketPlan.for_limits(max_num_seqs=6, max_num_batched_tokens=40, max_width=32,
                              min_tokens=16, min_width=8)
    assert p.row_sizes == (1, 2, 4, 6)
    assert p.token_sizes == (16, 32, 40)
    assert p.table_widths == (8, 16, 32)
    assert p.single_width().table_widths == (32,)
    # a budget below the row count still leaves a mixed bucket above the largest decode
    assert BucketPlan.for_limits(max_num_seqs=8, max_num_batched_tokens=4,
                                 max_width=4).token_sizes[-1] == 9


def test_shapes_are_decodes_then_mixed_with_fewer_rows_than_tokens():
    shapes = PLAN.shapes()
    decodes = [s for s in shapes if s[0] == s[1]]
    assert decodes == [(r, r, w) for r in (1, 2, 4) for w in (4, 8)]
    assert all(r < t for r, t, _ in shapes if (r, t) not in {(1, 1), (2, 2), (4, 4)})
    assert len(shapes) == len(set(shapes)) == 6 + 2 * (3 + 3)
    assert PLAN.mixed_rows(8) == (1, 2, 4) and PLAN.sample_rows() == (1, 2, 4)


def test_fit_pads_up_and_keeps_decodes_apart_from_mixed_steps():
    assert PLAN.fit(3, 3, 2) == (4, 4, 4)          # all decodes: T = R
    assert PLAN.fit(1, 5, 5) == (1, 8, 8)          # a prefill chunk
    assert PLAN.fit(4, 5, 4) == (4, 8, 4)          # T > R always, even when 5 would fit 4
    assert PLAN.fit(2, 16, 8) == (2, 16, 8)


@pytest.mark.parametrize("args, message", [
    ((5, 5, 1), "rows=5 exceeds the largest bucket 4"),
    ((1, 17, 1), "tokens=17 exceeds the largest bucket 16"),
    ((1, 1, 9), "block-table width=9 exceeds the largest bucket 8"),
    ((2, 1, 1), "a step needs >= 1 row and >= 1 token per row, got 2 rows and 1 tokens"),
])
def test_fit_errors_name_the_value(args, message):
    with pytest.raises(ValueError, match=message):
        PLAN.fit(*args)


def test_plan_errors_name_the_field():
    with pytest.raises(ValueError, match=r"row_sizes must be strictly increasing .*\(2, 1\)"):
        BucketPlan(row_sizes=(2, 1), token_sizes=(8,), table_widths=(4,))
    with pytest.raises(ValueError, match="largest token bucket \\(4\\) must exceed the largest "
                                         "row bucket \\(4\\)"):
        BucketPlan(row_sizes=(4,), token_sizes=(4,), table_widths=(4,))
