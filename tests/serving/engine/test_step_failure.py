"""A device error while a step's results are read back (JAX runs asynchronously, so a failed
step often shows only there): the requests in flight end with "error", the others and later
ones are served, in both engine modes and through the ThreadedEngine thread."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.serving.engine.conftest import collect, new_tiny_engine, request, tokens_of
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.engine.threaded_engine import ThreadedEngine
from xlaserve.serving.runner.runner import ModelRunner

PROMPT = list(range(1000, 1020))


def lose_nth_result(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner, n: int) -> None:
    """The n-th runner call (from 1) loses its sampled tokens on device: reading them back
    raises JAX's own error, as a failed device computation would."""
    real, calls = runner.sample, itertools.count(1)

    def sample(call, masks=None):
        result = real(call, masks)
        if next(calls) == n:
            result.out.tokens.delete()
        return result

    monkeypatch.setattr(runner, "sample", sample)


def run_with_recovery(engine: LLMEngine) -> dict[str, list]:
    """ThreadedEngine._loop's contract, synchronously: a failed step is followed by
    fail_in_flight, which must not raise."""
    out: dict[str, list] = {}
    failures = 0
    while engine.has_work():
        try:
            events = engine.step()
        except RuntimeError:
            failures += 1
            events = engine.fail_in_flight("device step failed")
        for ev in events:
            out.setdefault(ev.request_id, []).append(ev)
    engine.scheduler.check_integrity()
    assert failures == 1
    return out


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("failing_call", [2, 4])
def test_read_back_error_fails_in_flight_and_serves_the_rest(
        warm_tiny, monkeypatch, pipelined: bool, failing_call: int) -> None:
    alone = new_tiny_engine(warm_tiny, pipelined=pipelined)
    alone.add(request("ref", PROMPT, max_tokens=6, ignore_eos=True))
    expected = tokens_of(collect(alone)["ref"])

    engine = new_tiny_engine(warm_tiny, pipelined=pipelined, max_num_seqs=1)
    engine.add(request("a", PROMPT, max_tokens=8, ignore_eos=True))
    engine.add(request("waiting", PROMPT, max_tokens=6, ignore_eos=True))  # no room: waits
    lose_nth_result(monkeypatch, engine.runner, failing_call)
    out = run_with_recovery(engine)

    assert [ev.finish_reason for ev in out["a"] if ev.finished] == ["error"]
    assert out["a"][-1].error == "device step failed"
    assert [ev.finish_reason for ev in out["waiting"] if ev.finished] == ["length"]
    assert tokens_of(out["waiting"]) == expected

    engine.add(request("later", PROMPT, max_tokens=6, ignore_eos=True))
    later = collect(engine)["later"]
    assert later[-1].finish_reason == "length" and tokens_of(later) == expected


def test_async_engine_survives_read_back_error_and_failed_recovery(warm_tiny,
                                                                   monkeypatch) -> None:
    engine = new_tiny_engine(warm_tiny)   # pipelined, the default
    lose_nth_result(monkeypatch, engine.runner, 2)
    real_reset, resets = engine.runner.reset_state, itertools.count(1)

    def reset_state() -> None:           # the recovery's own device call fails the first time
        if next(resets) == 1:
            raise RuntimeError("reset failed")
        real_reset()

    monkeypatch.setattr(engine.runner, "reset_state", reset_state)
    front = ThreadedEngine(engine)

    async def finish_reasons(rid: str) -> list[str | None]:
        gen = front.submit(request(rid, PROMPT, max_tokens=6, ignore_eos=True))
        return [ev.finish_reason async for ev in gen]

    async def main() -> tuple[list[str | None], list[str | None]]:
        front.launch(warmup=False)
        first = await asyncio.wait_for(finish_reasons("a"), 30)
        second = await asyncio.wait_for(finish_reasons("b"), 30)   # the thread lives on
        return first, second

    try:
        first, second = asyncio.run(main())
    finally:
        front.shutdown()
    assert first[-1] == "error" and first.count("error") == 1
    assert front.last_error is not None and "has been deleted" in front.last_error
    assert second == [None] * 5 + ["length"]
