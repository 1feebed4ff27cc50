"""The stages of http/pipeline.py one at a time, without HTTP: each returns what the next needs
or raises the ApiError the client gets; `Intake` ends a failed request unserved (nothing
charged, one audit line) whatever ends it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.serving.fake_engine import FakeEngine
from xlaserve.serving.admission import Work
from xlaserve.serving.gateway.tracing import TraceContext
from xlaserve.serving.http.pipeline import (
    Intake,
    admit,
    authenticate,
    reserve,
    route,
    sampling_params,
    start_generation,
    tokenize,
)
from xlaserve.serving.http.errors import ApiError
from xlaserve.serving.http.protocol import parse
from xlaserve.serving.http.server import build_state
from xlaserve.serving.http.generation import Admitted
from xlaserve.serving.http.state import ServingState
from xlaserve.serving.server_config import AuditConfig, AuthConfig, ServedModel, ServerConfig
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import Tier


def make_state(tokenizer: Tokenizer, tmp_path: Path, **config: Any) -> ServingState:
    cfg = ServerConfig(models=(ServedModel("fake"),),
                       audit=AuditConfig(path=str(tmp_path / "audit.jsonl")), **config)
    return build_state(cfg, {"fake@1": [FakeEngine(tokenizer, max_model_len=64)]})


@pytest.fixture
def state(tokenizer: Tokenizer, tmp_path: Path) -> ServingState:
    return make_state(tokenizer, tmp_path)


def audit_lines(state: ServingState) -> list[dict]:
    assert state.audit is not None
    return [json.loads(line) for line in state.audit.path.read_text().splitlines()]


def rejections(state: ServingState, reason: str) -> float:
    v = state.metrics.registry.get_sample_value("xlaserve_rejections_total", {"reason": reason})
    return v or 0.0


def completion(prompt: object, **fields: object) -> dict:
    return {"model": "fake", "prompt": prompt, **fields}


def test_authenticate(state: ServingState, tokenizer: Tokenizer, tmp_path: Path) -> None:
    p = authenticate(state, None)  # auth off: everyone is the local internal tenant
    assert (p.tenant, p.tier) == ("local", Tier.INTERNAL)
    locked = make_state(tokenizer, tmp_path, auth=AuthConfig(
        mode="hs256", secret="s" * 40, audience="xlaserve", issuer="https://issuer.test"))
    with pytest.raises(ApiError) as e:
        authenticate(locked, "Bearer not.a.jwt")
    assert (e.value.status, e.value.code) == (401, "invalid_api_key")
    assert e.value.headers == {"WWW-Authenticate": 'Bearer realm="xlaserve"'}
    assert rejections(locked, "auth") == 1


def test_route_tokenizes_for_the_group(state: ServingState, tokenizer: Tokenizer) -> None:
    p = authenticate(state, None)
    msgs = [{"role": "user", "content": "hi"}]
    group, prompts = route(state, parse("chat", {"model": "fake", "messages": msgs}, 4), p)
    assert group.id == "fake@1"
    assert prompts == [tokenizer.encode_chat(msgs)]
    _, prompts = route(state, parse("completion", completion(["a b", "c"]), 4), p)
    assert prompts == [tokenizer.encode("a b"), tokenizer.encode("c")]
    _, prompts = route(state, parse("completion", completion([[5, 6], [7]]), 4), p)
    assert prompts == [[5, 6], [7]]
    with pytest.raises(ApiError) as e:
        route(state, parse("completion", completion("x", model="nope"), 4), p)
    assert (e.value.status, e.value.param) == (404, "model")


def test_tokenize_names_the_bad_token_ids(state: ServingState) -> None:
    vocab = state.router.groups[0].tokenizer.vocab_size
    with pytest.raises(ApiError) as e:
        tokenize(parse("completion", completion([1, vocab, vocab + 3]), 4),
                 state.router.groups[0])
    assert (e.value.status, e.value.param) == (400, "prompt")
    assert f"outside [0, {vocab}): [{vocab}, {vocab + 3}]" in e.value.message


def test_sampling_params_fit_the_context(state: ServingState) -> None:
    group = state.router.groups[0]          # max_model_len 64
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
    chat = parse("chat", body, 4)
    assert sampling_params(chat, group, [[1] * 10]).max_tokens == 54       # fills the room
    assert sampling_params(parse("completion", completion("x"), 4), group,
                           [[1] * 10]).max_tokens == 16
    with pytest.raises(ApiError) as e:
        sampling_params(parse("chat", {**body, "max_completion_tokens": 55}, 4), group,
                        [[1] * 10])
    assert (e.value.param, e.value.code) == ("max_completion_tokens", "context_length_exceeded")
    assert "55 > 54" in e.value.message
    with pytest.raises(ApiError) as e:
        sampling_params(chat, group, [[1] * 64])
    assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")


def test_reserve_holds_prompts_plus_n_x_max_tokens(state: ServingState) -> None:
    p = authenticate(state, None)
    r = reserve(state, p, [[1, 2, 3], [4]], 2, 5)
    assert (r.tenant, r.tokens) == ("local", 4 + 2 * 2 * 5)


def test_admit_takes_a_slot_per_choice(state: ServingState) -> None:
    p = authenticate(state, None)
    group = state.router.groups[0]
    parsed = parse("completion", completion(["a", "b"], n=3, priority=2), 8)
    ticket = asyncio.run(admit(state, group, p, parsed, [[1, 2, 3], [4]], 7))
    assert (ticket.weight, ticket.priority, ticket.work) == (6, 2, Work(2, 7))
    group.admission.release(ticket)
    engine = group.replicas[0].engine
    assert isinstance(engine, FakeEngine)
    engine.ready = False
    with pytest.raises(ApiError) as e:
        asyncio.run(admit(state, group, p, parsed, [[1]], 7))
    assert (e.value.status, e.value.code, e.value.headers) == (
        503, "model_not_ready", {"Retry-After": "5"})


def test_intake_ends_a_failed_request_unserved(state: ServingState) -> None:
    trace = TraceContext.from_headers("req-abc", None)
    p = authenticate(state, None)
    reservation = reserve(state, p, [[1, 2]], 1, 4)
    with pytest.raises(ApiError):
        with Intake(state, trace, "/v1/completions") as intake:
            intake.principal, intake.model, intake.reservation = p, "fake", reservation
            raise ApiError(400, "bad", "prompt", "invalid_value")
    assert reservation.settled
    assert rejections(state, "invalid_request") == 1
    with pytest.raises(asyncio.CancelledError):
        with Intake(state, trace, "/v1/chat/completions"):
            raise asyncio.CancelledError
    first, second = audit_lines(state)
    assert {k: first[k] for k in ("request_id", "tenant", "model", "status", "error")} == {
        "request_id": "req-abc", "tenant": "local", "model": "fake", "status": 400,
        "error": "invalid_value"}
    assert (second["tenant"], second["status"], second["error"]) == (
        None, 499, "client_disconnected")


def test_start_generation_fans_out_from_one_admitted(state: ServingState) -> None:
    p = authenticate(state, None)
    group = state.router.groups[0]
    parsed = parse("completion", completion(["a", "b"], n=2, seed=7, max_tokens=3), 8)
    prompts = tokenize(parsed, group)
    sampling = sampling_params(parsed, group, prompts)

    async def scenario() -> list[tuple[str, int | None]]:
        ticket = await admit(state, group, p, parsed, prompts, sampling.max_tokens)
        gen = start_generation(state, Admitted(
            trace=TraceContext.from_headers("req-x", None), endpoint="/v1/completions",
            arrived=0.0, principal=p, parsed=parsed, group=group, prompts=prompts,
            sampling=sampling, reservation=reserve(state, p, prompts, 2, 3), ticket=ticket))
        out = [(c.request.request_id, c.request.sampling.seed) for c in gen.choices]
        await gen.close()
        return out

    assert asyncio.run(scenario()) == [("req-x-0", 7), ("req-x-1", 8), ("req-x-2", 7),
                                       ("req-x-3", 8)]
    assert group.admission.running == 0 and not state.generations
    assert audit_lines(state)[0]["finish_reasons"] == ["abort"] * 4
