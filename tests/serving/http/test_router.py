"""Replica choice by load and prefix affinity, versions, and the model "auto"."""

from __future__ import annotations

import asyncio

import httpx
from tests.serving.fake_engine import FakeEngine

from xlaserve.serving.server_config import AutoRouteConfig, RouterConfig, ServedModel, ServerConfig


def test_affinity_spreading_and_overload(make_server, tokenizer):
    engines = [FakeEngine(tokenizer, "fake", token_delay=0.01) for _ in range(3)]
    cfg = ServerConfig(models=(ServedModel("fake"),),
                       router=RouterConfig(block_size=4, overload_slack=3))
    srv = make_server(cfg, {"fake@1": engines})
    prefixes = [f"Shared system prompt number {i} with enough words to fill blocks."
                for i in range(12)]

    def send(prompt: str) -> None:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": prompt,
                                                          "max_tokens": 2}, timeout=10)
        assert r.status_code == 200

    def replica_of(prompt_prefix: str) -> set[int]:
        return {i for i, e in enumerate(engines)
                for q in e.submitted if tokenizer.decode(q.prompt_token_ids)
                .startswith(prompt_prefix)}

    for p in prefixes:  # same prefix (first 2 blocks), different tails -> same replica
        send(p + " tail one")
        send(p + " tail two")
    for p in prefixes:
        assert len(replica_of(p)) == 1, p
    used = [len(e.submitted) for e in engines]
    assert all(u > 0 for u in used), used  # 12 prefixes spread over all 3 replicas

    # Overload: hold the preferred replica busy with long requests; newcomers go elsewhere.
    p = prefixes[0]
    preferred = replica_of(p).pop()
    engines[preferred].token_delay = 0.2

    async def flood() -> None:
        async with httpx.AsyncClient(timeout=20) as c:
            await asyncio.gather(*[c.post(srv.url + "/v1/completions", json={
                "model": "fake", "prompt": p + f" variant {i}", "max_tokens": 3})
                for i in range(8)])

    before = [len(e.submitted) for e in engines]
    asyncio.run(flood())
    moved = sum(len(e.submitted) - b for i, (e, b) in enumerate(zip(engines, before))
                if i != preferred)
    assert moved >= 3  # slack 3: at most ~3 stay on the busy replica, the rest spill over
    assert all(e.blocks_in_use == 0 for e in engines)


def test_versions_and_auto(make_server, tokenizer):
    cfg = ServerConfig(models=(ServedModel("small", version="1", default=False),
                               ServedModel("small", version="2"),
                               ServedModel("large")),
                       auto=AutoRouteConfig(small="small", large="large", threshold_tokens=8))
    engines = {"small@1": [FakeEngine(tokenizer, "small")],
               "small@2": [FakeEngine(tokenizer, "small")],
               "large@1": [FakeEngine(tokenizer, "large")]}
    srv = make_server(cfg, engines)
    ids = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
    assert ids == ["large", "small", "large@1", "small@1", "small@2", "auto"]

    def post(model: str, prompt: str) -> httpx.Response:
        return httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": prompt,
                                                             "max_tokens": 1}, timeout=10)

    assert post("small", "hi").json()["model"] == "small@2"
    assert post("small@1", "hi").json()["model"] == "small@1"
    short = post("auto", "a short one")
    assert short.headers["x-xlaserve-routed-model"] == "small@2"
    long = post("auto", "this prompt is clearly longer than eight tokens, by quite a lot")
    assert long.headers["x-xlaserve-routed-model"] == "large@1"
    assert long.json()["model"] == "large@1"
    assert "x-xlaserve-routed-model" not in post("small", "hi").headers
