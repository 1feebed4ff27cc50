"""OutputState's end of stream: text the detokenizer held back (an incomplete character) is
checked for stop strings too, whether the stream ends on a stop token or at max_tokens."""

from __future__ import annotations

import pytest

from xlaserve.serving.engine.output_state import OutputState
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import GenerationRequest, SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.load(model_dir)


def generated(tok: Tokenizer) -> list[int]:
    """" Q", ":", then a token that is a space and the first bytes of a 3-byte character: the
    detokenizer holds the space back until the character completes or the stream ends."""
    ids = tok.encode(" Q:") + [459]
    assert tok.token_bytes(459) == b" \xe2\x80"
    return ids


def feed(state: OutputState, ids: list[int]) -> tuple[str, str | None]:
    text = ""
    for t in ids:
        event, reason = state.accept(t, None)
        text += event.text
        if reason is not None:
            return text, reason
    return text, None


def state_for(tok: Tokenizer, max_tokens: int) -> OutputState:
    request = GenerationRequest("r", tok.encode("The quiz."),
                                SamplingParams(stop=("Q: ",), max_tokens=max_tokens))
    return OutputState.create(request, tok, (EOS,), tok.vocab_size)


def test_stop_token_flush_cuts_a_stop_string_in_held_back_text(tok: Tokenizer) -> None:
    state = state_for(tok, 16)
    text, reason = feed(state, generated(tok) + [EOS])
    assert (text, reason) == (" ", "stop")


def test_end_of_stream_flush_reports_a_stop_string_it_completes(tok: Tokenizer) -> None:
    state = state_for(tok, 3)
    text, reason = feed(state, generated(tok))
    assert reason is None                       # the engine ends it at max_tokens
    assert state.flush_text() == ("", True)     # ... and must report "stop", not "length"
    assert text == " "


def test_end_of_stream_flush_without_stop_string_emits_the_rest(tok: Tokenizer) -> None:
    state = state_for(tok, 3)
    text, _ = feed(state, tok.encode(" Q"))
    tail, stopped = state.flush_text()
    assert not stopped and text + tail == " Q"
