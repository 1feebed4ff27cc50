"""Constrained decoding in the engine: every sampled token is one the grammar allowed, the
request ends when the grammar is complete, unconstrained rows batched with constrained ones are
unchanged token for token, pipelining stays on, and nothing compiles after warm-up."""

from __future__ import annotations

import json
import re
from typing import Literal

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.serving.engine.conftest import (
    collect,
    new_engine,
    new_tiny_engine,
    request,
    text_of,
    tokens_of,
)
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.serving.runner.token_mask import all_allowed, mask_as_bias, unpack
from xlaserve.serving.structured.constraint import Constraint
from xlaserve.serving.structured.grammar import GrammarError


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    pets: list[Literal["cat", "dog"]] = Field(max_length=3)


def test_mask_packing_round_trips() -> None:
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 100)) < 0.3
    words = np.zeros((3, 4), np.uint32)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    mask = words.view(np.int32)
    assert (unpack(mask, 100) == allowed).all()
    bias = mask_as_bias(mask, None, 100)
    assert (np.isneginf(bias) == ~allowed).all() and (bias[allowed] == 0).all()
    assert unpack(all_allowed(2, 100), 100).all()


@pytest.mark.parametrize("pipelined", [True, False])
def test_random_model_keeps_to_grammars(warm_tiny, pipelined) -> None:
    """A random model left to itself writes noise; under a constraint every output matches,
    at temperature 1, and the free request beside them is what it is alone."""
    tok = warm_tiny.tokenizer
    prompt = tok.encode("Pick one")
    alone = new_tiny_engine(warm_tiny)
    alone.add(request("free", prompt, max_tokens=12, ignore_eos=True))
    free_alone = tokens_of(collect(alone)["free"])

    engine = new_tiny_engine(warm_tiny, pipelined=pipelined)
    cases = {"regex": (Constraint("regex", r"[0-9]{2}-[a-z]{3}"),
                       lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{3}", t)),
             "choice": (Constraint.choice(["red", "green", "blue"]),
                        lambda t: t in ("red", "green", "blue")),
             "json": (Constraint.json_schema({"type": "object", "properties": {
                 "ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}), lambda t: json.loads(t) in (
                 {"ok": True}, {"ok": False}))}
    for name, (c, _) in cases.items():
        engine.add(request(name, prompt, max_tokens=24, temperature=1.0, seed=7, constraint=c))
    engine.add(request("free", prompt, max_tokens=12, ignore_eos=True))
    with CompileCounter() as compiles:
        out = collect(engine)
    assert compiles.count == 0
    assert tokens_of(out["free"]) == free_alone
    for name, (_, ok) in cases.items():
        assert out[name][-1].finish_reason == "stop", (name, text_of(out[name]))
        assert ok(text_of(out[name])), (name, text_of(out[name]))



def test_bad_grammar_is_refused_before_queueing(warm_tiny) -> None:
    engine = new_tiny_engine(warm_tiny)
    with pytest.raises(GrammarError, match="regex"):
        engine.add(request("bad", [1, 2], constraint=Constraint("regex", "((")))
    assert not engine.has_work()


def test_smollm2_json_schema_is_valid(warm_engine, smollm2) -> None:
    """The real model under a schema, sampled: every output parses and validates."""
    engine = new_engine(warm_engine, smollm2)
    tok = smollm2.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    c = Constraint.json_schema(Person.model_json_schema())
    for i in range(4):
        engine.add(request(f"r{i}", ids, max_tokens=60, temperature=1.0, seed=i, constraint=c))
    engine.add(request("free", ids, max_tokens=20))
    with CompileCounter() as compiles:
        out = collect(engine)
    assert compiles.count == 0
    for i in range(4):
        assert out[f"r{i}"][-1].finish_reason == "stop", text_of(out[f"r{i}"])
        Person.model_validate_json(text_of(out[f"r{i}"]))


def test_grammar_state_rolls_back(warm_tiny) -> None:
    """Speculative decoding's hook: undone tokens give back the masks from before them."""
    from xlaserve.serving.structured.grammar import GrammarCompiler, words

    tok = warm_tiny.tokenizer
    state = GrammarCompiler(tok, 49152).start(Constraint.choice(["12-ab", "34-cd"]))
    before = np.zeros(words(49152), np.int32)
    state.fill(before)
    ids = tok.encode("12-ab", add_special_tokens=False)
    assert all(state.accept(t) for t in ids) and state.done
    state.rollback(len(ids))
    again = np.zeros_like(before)
    state.fill(again)
    assert (again == before).all() and not state.done and state.accepted == 0
    with pytest.raises(ValueError, match="cannot roll back 1 of 0"):
        state.rollback(1)


class _RecordingChannel:
    """Stands in for process 0's step channel (the broadcast itself is tested in
    tests/multidevice/test_multihost.py): keeps what would be sent."""

    is_leader = True

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, op, host=None) -> None:
        self.sent.append(host)


def test_multihost_leader_sends_the_mask_folded_into_the_bias(warm_tiny) -> None:
    engine = new_tiny_engine(warm_tiny)
    channel = _RecordingChannel()
    engine.runner.channel = channel
    try:
        engine.add(request("c", warm_tiny.tokenizer.encode("Pick"), max_tokens=8,
                           temperature=1.0, seed=3, constraint=Constraint.choice(["on", "off"])))
        out = collect(engine)
    finally:
        engine.runner.channel = None
    assert text_of(out["c"]) in ("on", "off")
    steps = [h for h in channel.sent if h is not None]
    # every step the request ran in carried its mask as -inf bias (a handful of tokens
    # allowed); the last, scheduled before its end was known, allows everything
    assert len(steps) >= 2 and all(np.isneginf(h.bias[0]).sum() > 49000 for h in steps[:-1])
    assert not np.isneginf(steps[-1].bias).any()
