"""Sampling values at the edge of what the device holds: top_k past the vocabulary (up to
int32) keeps every token, i.e. is off, and never fails the step (other requests' included);
past int32 SamplingParams refuses it, so no row ever carries it."""

from __future__ import annotations

import pytest

from tests.serving.engine.conftest import collect, new_tiny_engine, request, tokens_of
from xlaserve.serving.types import MAX_INT32, SamplingParams

PROMPT = list(range(2000, 2012))


def test_runner_writes_top_k_past_the_vocabulary_as_off(warm_tiny) -> None:
    runner = warm_tiny.runner
    vocab = runner.config.vocab_size
    ks = [vocab - 1, vocab, MAX_INT32]
    rows = [runner.row(f"k{i}", [5], 0, [i + 1], sampling=SamplingParams(temperature=1.0,
                                                                           top_k=k))
            for i, k in enumerate(ks)]
    try:
        host = runner.host_step(rows)   # a decode call
    finally:
        for row in rows:
            runner.cells.release(row.request_id)
    assert host.top_k[:len(ks)].tolist() == [vocab - 1, 0, 0]


def test_top_k_past_int32_is_refused_before_any_row_holds_it() -> None:
    with pytest.raises(ValueError, match=r"top_k=1099511627776: must be an integer in"):
        SamplingParams(top_k=2 ** 40)


def test_top_k_at_or_past_the_vocabulary_samples_as_off(warm_tiny) -> None:
    vocab = warm_tiny.model_config.vocab_size
    out = {}
    for top_k in (0, vocab, MAX_INT32):
        engine = new_tiny_engine(warm_tiny)
        engine.add(request("other", PROMPT[::-1], max_tokens=8, ignore_eos=True))
        engine.add(request("k", PROMPT, max_tokens=8, temperature=1.0, seed=7, top_k=top_k,
                           ignore_eos=True))
        events = collect(engine)
        assert [ev.finish_reason for ev in events["other"] if ev.finished] == ["length"]
        out[top_k] = tokens_of(events["k"])
    assert len(out[0]) == 8 and out[vocab] == out[0] and out[MAX_INT32] == out[0]
