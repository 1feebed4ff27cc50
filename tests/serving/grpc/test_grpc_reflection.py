"""gRPC server reflection and health on a worker (serving/grpc/server.py): a reflection client
lists the services as `grpcurl list` does and resolves Generation's methods from the worker's
own descriptors; health answers NOT_SERVING while the engine warms up and SERVING after; both
stay open on a worker that demands a token, Generation does not."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.serving.fake_engine import FakeEngine
from tests.serving.grpc.grpc_worker import Worker
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.grpc.auth import WorkerAuth

TOKEN = "reflection-test-token-0123456789"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def list_services(channel: grpc.aio.Channel) -> list[str]:
    """What `grpcurl -plaintext HOST:PORT list` prints: the ListServices answer."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = [a async for a in stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)]
    return sorted(s.name for s in answers[0].list_services_response.service)


async def health_status(channel: grpc.aio.Channel, service: str) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def wait_status(channel: grpc.aio.Channel, service: str, want: int) -> int:
    """The health status once it is `want`, or the last one seen after 3 s."""
    for _ in range(60):
        status = await health_status(channel, service)
        if status == want:
            break
        await asyncio.sleep(0.05)
    return status


def test_reflection_lists_and_describes_services_without_the_token(tokenizer):
    with Worker(FakeEngine(tokenizer, "fake"), WorkerAuth(token=TOKEN)) as worker:
        async def scenario() -> None:
            async with grpc.aio.insecure_channel(worker.target) as ch:   # no token
                assert await list_services(ch) == [
                    "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                    "xlaserve.v1.Generation"]
                try:
                    await pb_grpc.GenerationStub(ch).ListModels(pb.ListModelsRequest(),
                                                                timeout=5)
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                assert code == grpc.StatusCode.UNAUTHENTICATED

        asyncio.run(scenario())
        # `grpcurl describe xlaserve.v1.Generation`: the schema comes from the worker alone
        with grpc.insecure_channel(worker.target) as ch:
            pool = DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
            svc = pool.FindServiceByName("xlaserve.v1.Generation")
            generate = svc.methods_by_name["Generate"]
            assert sorted(svc.methods_by_name) == ["Abort", "ExportKV", "Generate", "GetStats",
                                                   "ListModels", "PrefetchKV"]
            assert generate.input_type.full_name == "xlaserve.v1.GenerateRequest"
            assert generate.server_streaming and not generate.client_streaming
            fields = generate.input_type.fields_by_name
            assert fields["prompt_token_ids"].number == 3
            assert fields["sampling"].message_type.fields_by_name["max_tokens"].number == 1


def test_health_is_serving_only_after_warm_up(tokenizer):
    eng = FakeEngine(tokenizer, "fake")
    eng.ready = False   # warming up
    with Worker(eng, WorkerAuth(token=TOKEN)) as worker:
        async def scenario() -> None:
            async with grpc.aio.insecure_channel(worker.target) as ch:   # no token
                for service in ("", "xlaserve.v1.Generation"):
                    assert await wait_status(ch, service, NOT_SERVING) == NOT_SERVING
                watch = health_pb2_grpc.HealthStub(ch).Watch(
                    health_pb2.HealthCheckRequest(service="xlaserve.v1.Generation"),
                    timeout=5)
                assert (await watch.read()).status == NOT_SERVING
                eng.ready = True   # warm-up done
                assert (await watch.read()).status == SERVING   # pushed, not polled
                watch.cancel()
                for service in ("", "xlaserve.v1.Generation"):
                    assert await health_status(ch, service) == SERVING

        asyncio.run(scenario())
