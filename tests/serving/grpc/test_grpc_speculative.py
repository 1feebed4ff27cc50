"""Speculative decoding across the gRPC hop: a real engine (the tiny model, method "draft"
with its own single layer as the draft, so greedy drafts are all accepted) behind
`xlaserve worker`'s server, reached through RemoteEngine: a request's opt-out reaches the
engine, its draft counters come back in its usage, the engine's in GetStats."""

from __future__ import annotations

import asyncio

import pytest

from tests.serving.engine.conftest import (
    TINY_CONFIG,
    TINY_ENGINE_CONFIG,
    tokens_of,
    warm_tiny,  # noqa: F401 (fixture)
)
from xlaserve.models.llama import init_params
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.engine.threaded_engine import ThreadedEngine
from xlaserve.serving.grpc.client import RemoteEngine
from xlaserve.serving.grpc.server import start_grpc_server
from xlaserve.serving.speculative import SpeculativeConfig
from xlaserve.serving.types import EngineEvent, GenerationRequest, SamplingParams

SPEC = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_layers=1)
PROMPT = [5, 17, 3, 99, 4321, 12, 7, 7, 801]


@pytest.fixture(scope="module")
def engine(warm_tiny) -> LLMEngine:  # noqa: F811
    params = init_params(TINY_CONFIG, 0, scale=0.5)   # warm_tiny's (its runner's are packed)
    e = LLMEngine(params, TINY_CONFIG, warm_tiny.tokenizer,
                  warm_tiny.runner.mesh, TINY_ENGINE_CONFIG.with_args(speculative=SPEC),
                  runner=warm_tiny.runner)
    assert e.draft is not None
    e.draft.runner.warmup()
    return e


def request(rid: str, speculative: bool) -> GenerationRequest:
    return GenerationRequest(rid, list(PROMPT), SamplingParams(max_tokens=13, temperature=0.0,
                                                               ignore_eos=True),
                             speculative=speculative)


def test_opt_out_and_counters_cross_the_grpc_hop(engine, warm_tiny) -> None:  # noqa: F811
    front = ThreadedEngine(engine, "tiny")
    front.launch(warmup=False)

    async def scenario() -> tuple[list[EngineEvent], list[EngineEvent], object]:
        server, port, watcher = await start_grpc_server({"tiny": front}, "127.0.0.1:0")
        client = RemoteEngine(f"127.0.0.1:{port}", "tiny", warm_tiny.tokenizer,
                              poll_interval=0.05)
        try:
            await client.start()
            spec = [ev async for ev in client.submit(request("spec", True))]
            plain = [ev async for ev in client.submit(request("plain", False))]
            await asyncio.sleep(0.2)        # a stats poll after both ended
            return spec, plain, client.stats()
        finally:
            await client.stop()
            watcher.cancel()
            await server.stop(0)

    try:
        spec, plain, stats = asyncio.run(scenario())
    finally:
        front.shutdown()
    assert tokens_of(spec) == tokens_of(plain) and len(tokens_of(spec)) == 13
    used, skipped = spec[-1].usage, plain[-1].usage
    assert used is not None and skipped is not None
    # the draft is the model itself: every greedy draft is the target's token
    assert used.num_draft_tokens > 0 and used.num_accepted_tokens == used.num_draft_tokens
    assert max(len(ev.token_ids) for ev in spec) > 1          # several tokens in one event
    assert (skipped.num_draft_tokens, skipped.num_accepted_tokens) == (0, 0)   # opted out
    assert max(len(ev.token_ids) for ev in plain) == 1
    assert stats.spec_num_draft_tokens == used.num_draft_tokens
    assert stats.spec_num_accepted_tokens == used.num_accepted_tokens
    assert stats.spec_num_drafts == sum(stats.spec_acceptance_counts) > 0
