"""CallProfile: per-bucket sums, phases, ordering and the checks on what it is given."""

from __future__ import annotations

import pytest

from xlaserve.serving.runner.call_profile import CallProfile


def test_sums_per_bucket_and_phase() -> None:
    p = CallProfile()
    p.record((4, 4, 16), 0.010, 3)     # a decode bucket: one token per row
    p.record((4, 4, 16), 0.030, 4)
    p.record((1, 64, 16), 0.100, 40)
    rows = p.rows()
    assert [(r["rows"], r["tokens"], r["width"]) for r in rows] == [(1, 64, 16), (4, 4, 16)]
    assert rows[1] == {"rows": 4, "tokens": 4, "width": 16, "calls": 2,
                       "seconds": pytest.approx(0.04), "ms_per_call": pytest.approx(20.0),
                       "real_tokens": 7, "padded_tokens": 8}
    assert p.phase_seconds() == {"decode": pytest.approx(0.04), "prefill": pytest.approx(0.1)}
    assert p.seconds == pytest.approx(0.14)
    text = p.format(top=1)
    assert "| (1, 64, 16) | 1 | 0.10 | 71% | 100.0 | 40 / 64 |" in text
    assert "1 more buckets | 2 | 0.04" in text


@pytest.mark.parametrize("seconds, real", [(-1.0, 1), (0.1, 0), (0.1, 5)])
def test_rejects_impossible_calls(seconds: float, real: int) -> None:
    with pytest.raises(ValueError, match=r"call \(4, 4, 16\)"):
        CallProfile().record((4, 4, 16), seconds, real)
