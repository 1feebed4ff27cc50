"""Sampling and stopping through the engine: seeds, stop strings, logprobs, penalties, limits."""

from __future__ import annotations

import numpy as np

from tests.helpers import full_logits
from tests.serving.engine.conftest import collect, prompt, request, text_of, tokens_of


def test_seed_gives_same_text_whatever_else_is_batched(engine, warm_engine, smollm2,
                                                       corpus_ids) -> None:
    from tests.serving.engine.conftest import new_engine

    rng = np.random.default_rng(11)
    ids = prompt(corpus_ids, rng, 40)
    params = dict(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                  ignore_eos=True)
    engine.add(request("alone", ids, **params))
    alone = tokens_of(collect(engine)["alone"])

    busy = new_engine(warm_engine, smollm2)
    for i in range(4):
        busy.add(request(f"x{i}", prompt(corpus_ids, rng, 30 + 10 * i), max_tokens=24,
                         temperature=1.0, ignore_eos=True))
    busy.add(request("crowded", ids, **params))
    assert tokens_of(collect(busy)["crowded"]) == alone

    other = new_engine(warm_engine, smollm2)
    other.add(request("reseeded", ids, **{**params, "seed": 99}))
    assert tokens_of(collect(other)["reseeded"]) != alone


def test_stop_string_cuts_text_without_leaking(engine, smollm2) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Count from 1 to 20, comma separated."}])
    engine.add(request("free", ids, max_tokens=60))
    full = text_of(collect(engine)["free"])
    assert "7" in full
    stop = full[full.index("7"):full.index("7") + 2]  # e.g. "7,": spans tokens
    engine.add(request("stopped", ids, max_tokens=60, stop=(stop, "never-there")))
    evs = collect(engine)["stopped"]
    text = text_of(evs)
    assert evs[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]
    assert stop[0] not in text[-1:]  # no partial stop string leaked into the stream


def test_logprobs_top_n(engine, smollm2, corpus_ids) -> None:
    ids = prompt(corpus_ids, np.random.default_rng(2), 25)
    engine.add(request("lp", ids, max_tokens=6, logprobs=5, ignore_eos=True))
    evs = [e for e in collect(engine)["lp"] if e.token_ids]
    logits = full_logits(smollm2.params, smollm2.config, ids + tokens_of(evs)[:-1])
    for j, ev in enumerate(evs):
        (lp,) = ev.logprobs
        assert len(lp.top) == 5
        assert [t for t, _ in lp.top] == list(np.argsort(-logits[len(ids) - 1 + j])[:5])
        assert lp.top[0][0] == lp.token_id  # greedy: the sampled token is the best one
        assert abs(lp.top[0][1] - lp.logprob) < 1e-6
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


def test_presence_penalty_is_applied_exactly(engine, smollm2, corpus_ids) -> None:
    ids = prompt(corpus_ids, np.random.default_rng(9), 30)
    engine.add(request("pen", ids, max_tokens=12, presence_penalty=1.5, frequency_penalty=0.5,
                       ignore_eos=True))
    out = tokens_of(collect(engine)["pen"])
    logits = full_logits(smollm2.params, smollm2.config, ids + out[:-1])[len(ids) - 1:]
    for j, token in enumerate(out):
        counts: dict[int, int] = {}
        for t in out[:j]:
            counts[t] = counts.get(t, 0) + 1
        z = logits[j].astype(np.float64)
        for t, c in counts.items():
            z[t] -= 1.5 + 0.5 * c
        assert token == int(np.argmax(z)), j


def test_max_tokens_and_context_limit(engine, corpus_ids) -> None:
    rng = np.random.default_rng(4)
    engine.add(request("short", prompt(corpus_ids, rng, 10), max_tokens=3, ignore_eos=True))
    # 1020 prompt tokens in a 1024-token context: only 4 can be generated.
    engine.add(request("ctx", prompt(corpus_ids, rng, 1020), max_tokens=50, ignore_eos=True))
    out = collect(engine)
    assert len(tokens_of(out["short"])) == 3 and out["short"][-1].finish_reason == "length"
    assert len(tokens_of(out["ctx"])) == 4 and out["ctx"][-1].finish_reason == "length"
    assert out["ctx"][-1].usage.prompt_tokens == 1020
