"""A request id reused right after its request was aborted (issue 12.7).  The engine thread
handles the abort at its next turn, so for a moment the old request still holds the id: the
engine holds a new submit with that id until its thread has let go of the old request (the new
one then runs in full and never receives the old one's abort event), and the gRPC worker keeps
the id reserved until it has handed the old request's abort to the engine."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from tests.serving.engine.conftest import collect, new_tiny_engine, request, tokens_of
from xlaserve.serving.engine.threaded_engine import ThreadedEngine
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.grpc.server import start_grpc_server
from xlaserve.serving.types import EngineEvent

PROMPT = list(range(1000, 1020))


@pytest.fixture
def expected(warm_tiny) -> list[int]:
    """The 6 tokens a request for PROMPT gets on an engine of its own."""
    alone = new_tiny_engine(warm_tiny)
    alone.add(request("ref", PROMPT, max_tokens=6, ignore_eos=True))
    return tokens_of(collect(alone)["ref"])


def test_submit_reusing_an_aborted_id_waits_until_the_engine_let_go(warm_tiny, expected):
    front = ThreadedEngine(new_tiny_engine(warm_tiny))

    async def events(rid: str, max_tokens: int) -> list[EngineEvent]:
        stream = front.submit(request(rid, PROMPT, max_tokens=max_tokens, ignore_eos=True))
        return [ev async for ev in stream]

    async def main() -> tuple[list[EngineEvent], list[EngineEvent]]:
        old = asyncio.ensure_future(events("r", 40))
        await asyncio.sleep(0)          # old is submitted; the engine thread does not run yet
        await front.abort("r")
        new = asyncio.ensure_future(events("r", 6))
        await asyncio.sleep(0.05)
        assert not new.done()           # not refused: it waits for the engine thread
        front.launch(warmup=False)
        return await asyncio.wait_for(old, 30), await asyncio.wait_for(new, 30)

    try:
        old, new = asyncio.run(main())
    finally:
        front.shutdown()
    assert [ev.finish_reason for ev in old] == ["abort"]
    assert tokens_of(new) == expected and new[-1].finish_reason == "length"
    front.engine.scheduler.check_integrity()
    assert front.stats().kv_blocks_used == 0


def test_grpc_request_id_reused_right_after_a_cancel(warm_tiny, expected, monkeypatch):
    """The client cancels a Generate and sends another with the same request_id while the
    engine thread is held up (the gate, closed after the first token): the second is served in
    full once the thread moves on."""
    engine = new_tiny_engine(warm_tiny)
    gate, held = threading.Event(), threading.Event()
    gate.set()
    real_step = engine.step

    def gated_step() -> list[EngineEvent]:
        gate.wait()
        events = real_step()
        if not held.is_set() and any(ev.token_ids for ev in events):
            held.set()
            gate.clear()
        return events

    monkeypatch.setattr(engine, "step", gated_step)
    front = ThreadedEngine(engine, "tiny")

    def generate(stub: pb_grpc.GenerationStub, max_tokens: int):
        return stub.Generate(pb.GenerateRequest(
            request_id="r", prompt_token_ids=PROMPT,
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)), timeout=30)

    async def reuse(stub: pb_grpc.GenerationStub) -> list[pb.GenerateResponse]:
        """Generate "r" again, retrying while the worker still tears the cancelled call down
        (ALREADY_EXISTS), as a client would."""
        for _ in range(200):
            try:
                return [m async for m in generate(stub, 6)]
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
            await asyncio.sleep(0.01)
        raise AssertionError("request_id 'r' stayed reserved")

    async def scenario() -> list[pb.GenerateResponse]:
        front.launch(warmup=False)
        server, port, watcher = await start_grpc_server({"tiny": front}, "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                old = generate(stub, 40)
                await old.read()                  # its first token: the gate is closed
                old.cancel()
                asyncio.get_running_loop().call_later(0.3, gate.set)
                return await reuse(stub)
        finally:
            gate.set()
            watcher.cancel()
            await server.stop(0)

    try:
        msgs = asyncio.run(scenario())
    finally:
        front.shutdown()
    assert [t for m in msgs for t in m.token_ids] == expected
    assert msgs[-1].finish_reason == "length"
    front.engine.scheduler.check_integrity()
    assert front.stats().kv_blocks_used == 0
