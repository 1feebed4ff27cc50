"""SamplingParams validation: every bad value is a ValueError that names the field and shows
the value, including values that would only overflow later on the device (int32)."""

from __future__ import annotations

import pytest

from xlaserve.serving.types import MAX_INT32, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("top_k", MAX_INT32 + 1), ("top_k", 2 ** 63), ("top_k", -1), ("top_k", 2.0),
    ("top_k", True), ("max_tokens", True), ("max_tokens", 4.0), ("max_tokens", 0),
    ("logprobs", 2.5), ("logprobs", True), ("logprobs", 21), ("seed", 1.5), ("seed", "7"),
])
def test_bad_integer_fields_are_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}={value!r}: must be an integer"):
        SamplingParams(**{field: value})


def test_integer_fields_at_their_limits_are_kept() -> None:
    s = SamplingParams(max_tokens=1, top_k=MAX_INT32, logprobs=0, seed=-(2 ** 63))
    assert (s.max_tokens, s.top_k, s.logprobs, s.seed) == (1, MAX_INT32, 0, -(2 ** 63))
    assert SamplingParams(logprobs=20, top_k=0).logprobs == 20
