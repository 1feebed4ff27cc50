"""gRPC: streaming Generate, ListModels, health, deadline and cancellation abort the engine
request, and RemoteEngine as a router replica behind the HTTP API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.serving.fake_engine import FakeEngine, expected_ids
from tests.serving.grpc.grpc_worker import Worker
from tests.serving.live_server import wait_for
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.grpc.client import RemoteEngine
from xlaserve.serving.grpc.server import start_grpc_server
from xlaserve.serving.server_config import ServedModel, ServerConfig
from xlaserve.serving.types import EngineEvent, GenerationRequest


async def freed(eng: FakeEngine, rid: str, timeout: float = 2.0) -> None:
    """Wait (up to `timeout`) until `rid` ended aborted, its blocks are back and the server's
    abort call reached the engine (it runs after the stream's cancellation, in a task of its
    own, so it may come a moment after the other two)."""
    for _ in range(int(timeout / 0.02)):
        if rid in eng.aborted and eng.blocks_in_use == 0 and rid in eng.abort_calls:
            return
        await asyncio.sleep(0.02)


def test_generate_stream_models_health_deadline_cancel(tokenizer):
    eng = FakeEngine(tokenizer, "fake", token_delay=0.02)

    async def scenario() -> None:
        server, port, watcher = await start_grpc_server({"fake": eng}, "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.GenerationStub(ch)
                health = health_pb2_grpc.HealthStub(ch)
                await asyncio.sleep(0.3)
                h = await health.Check(health_pb2.HealthCheckRequest(
                    service="xlaserve.v1.Generation"), timeout=30)
                assert h.status == health_pb2.HealthCheckResponse.SERVING
                models = await stub.ListModels(pb.ListModelsRequest(), timeout=30)
                assert [(m.name, m.max_model_len) for m in models.models] == [("fake", 512)]

                prompt = tokenizer.encode("one two three four")
                msgs = [m async for m in stub.Generate(pb.GenerateRequest(
                    prompt="one two three four", request_id="g1",
                    sampling=pb.SamplingParams(max_tokens=5, logprobs=1)), timeout=5)]
                ids = [t for m in msgs for t in m.token_ids]
                assert ids == expected_ids(prompt, 5)
                assert "".join(m.text for m in msgs) == tokenizer.decode(ids)
                assert msgs[-1].finish_reason == "length"
                assert msgs[-1].usage.completion_tokens == 5
                assert len(msgs[0].logprobs) == 1 and len(msgs[0].logprobs[0].top_token_ids) == 1

                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(pb.GenerateRequest(
                        prompt_token_ids=[5, 6], sampling=pb.SamplingParams(max_tokens=0)),
                        timeout=30).read()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                # the HTTP API's check of max_tokens against the context (types.py)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(pb.GenerateRequest(
                        prompt_token_ids=[5, 6], sampling=pb.SamplingParams(max_tokens=511)),
                        timeout=30).read()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details() == ("'max_tokens' is too large: 511 > 510 (this model's "
                                             "maximum context length is 512 tokens and the "
                                             "prompt has 2)")

                # deadline: the stream would take 4 s; the call gives up after 0.3 s
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.GenerateRequest(
                            prompt="a b c d", request_id="slow",
                            sampling=pb.SamplingParams(max_tokens=200)), timeout=0.3):
                        pass
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await freed(eng, "slow")
                assert "slow" in eng.aborted and eng.blocks_in_use == 0
                assert "slow" in eng.abort_calls

                # client cancellation
                call = stub.Generate(pb.GenerateRequest(
                    prompt="a b c d", request_id="cancelme",
                    sampling=pb.SamplingParams(max_tokens=200)))
                await call.read()
                await call.read()
                call.cancel()
                await freed(eng, "cancelme")
                assert "cancelme" in eng.aborted and eng.blocks_in_use == 0
                assert "cancelme" in eng.abort_calls
        finally:
            watcher.cancel()
            await server.stop(0)

    asyncio.run(scenario())


class SlowAbortEngine(FakeEngine):
    """A FakeEngine whose abort takes 0.2 s; each submit records the aborts done by then."""

    def __init__(self, *args: object, **kwargs: object):
        super().__init__(*args, **kwargs)
        self.aborts_before: list[list[str]] = []   # per submit: abort_calls at that moment

    async def abort(self, request_id: str) -> None:
        await asyncio.sleep(0.2)
        await super().abort(request_id)

    def submit(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        self.aborts_before.append(list(self.abort_calls))
        return super().submit(request)


def test_request_id_stays_reserved_until_its_abort_is_done(tokenizer):
    """A cancelled Generate's id is taken again only after the worker's abort of the old
    request returned: an abort landing later could hit the new request."""
    eng = SlowAbortEngine(tokenizer, "fake", token_delay=0.02)

    def generate(stub: pb_grpc.GenerationStub, max_tokens: int):
        return stub.Generate(pb.GenerateRequest(
            prompt="a b c d", request_id="r", sampling=pb.SamplingParams(max_tokens=max_tokens)),
            timeout=5)

    async def scenario() -> list[int]:
        server, port, watcher = await start_grpc_server({"fake": eng}, "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.GenerationStub(ch)
                old = generate(stub, 200)
                await old.read()
                old.cancel()
                for _ in range(200):
                    try:
                        return [t async for m in generate(stub, 4) for t in m.token_ids]
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.ALREADY_EXISTS, e
                    await asyncio.sleep(0.01)
                raise AssertionError("request_id 'r' stayed reserved")
        finally:
            watcher.cancel()
            await server.stop(0)

    ids = asyncio.run(scenario())
    assert ids == expected_ids(tokenizer.encode("a b c d"), 4)
    assert eng.aborts_before == [[], ["r"]]


def test_remote_replicas_behind_http(make_server, tokenizer):
    engines = [FakeEngine(tokenizer, "fake", token_delay=0.02) for _ in range(2)]
    with Worker(engines[0]) as w0, Worker(engines[1]) as w1:
        remotes = [RemoteEngine(f"127.0.0.1:{w.port}", "fake", tokenizer, poll_interval=0.1)
                   for w in (w0, w1)]
        cfg = ServerConfig(models=(ServedModel("fake", replicas=(
            f"grpc://127.0.0.1:{w0.port}", f"grpc://127.0.0.1:{w1.port}")),))
        srv = make_server(cfg, {"fake@1": remotes})
        assert wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for i in range(4):
            p = f"prompt number {i} for the remote replicas"
            r = c.completions.create(model="fake", prompt=p, max_tokens=4)
            assert r.choices[0].text == tokenizer.decode(expected_ids(tokenizer.encode(p), 4))
        assert sum(len(e.submitted) for e in engines) == 4
        # a client that goes away aborts the request on the worker
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={
                "model": "fake", "prompt": "a long one", "max_tokens": 300}, timeout=0.4)
        assert wait_for(lambda: all(e.blocks_in_use == 0 and not e.running for e in engines), 3)
        assert sum(len(e.aborted) for e in engines) == 1
        m = httpx.get(srv.url + "/metrics").text
        assert 'xlaserve_kv_cache_blocks_total{engine="fake@1/1",model_name="fake@1"} 4096.0' in m
