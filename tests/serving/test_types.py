"""SamplingParams validation: every bad value is a ValueError that names the field and shows
the value, including values that would only overflow later on the device (int32); max_tokens
against the context, as every front end checks it."""

from __future__ import annotations

import pytest

from xlaserve.serving.types import (MAX_INT32, ContextLengthExceeded, SamplingParams,
                                    checked_max_tokens)


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


def test_max_tokens_checked_against_the_room_the_prompt_leaves() -> None:
    assert checked_max_tokens(10, 6, 16) == 6          # prompt + max_tokens == the context
    assert checked_max_tokens(10, None, 16) == 6       # unset: the room
    assert checked_max_tokens(10, None, 64, unset=16) == 16
    assert checked_max_tokens(10, None, 16, unset=16) == 6
    with pytest.raises(ContextLengthExceeded, match=r"^'max_completion_tokens' is too large: "
                       r"7 > 6 \(this model's maximum context length is 16 tokens and the "
                       r"prompt has 10\)$") as e:
        checked_max_tokens(10, 7, 16, name="max_completion_tokens")
    assert e.value.field == "max_completion_tokens"
    with pytest.raises(ContextLengthExceeded, match=r"^This model's maximum context length is "
                       r"16 tokens; the prompt has 16 tokens$") as e:
        checked_max_tokens(16, 1, 16)
    assert e.value.field == "prompt"
