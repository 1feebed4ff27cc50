"""Two `xlaserve worker` processes (SmolLM2 behind gRPC) and an `xlaserve serve` process routing
to both (configs/worker.toml, configs/router.toml), the workers admitting only callers with a
client certificate from the test CA and the bearer token (mTLS + token, as deployed):

- a grpcio client streams from a worker exactly the tokens the HTTP API returns for the same
  seed, and a deadline aborts its request and frees its blocks;
- the router spreads requests with different prefixes over both replicas and keeps a
  conversation (a shared prefix) on one;
- a caller without the token, or without TLS, is turned away;
- SIGKILL of one worker mid-run ends each of its in-flight requests with an explicit error,
  new requests go to the survivor, and the front end stays up.

Which replica served a request is read from the workers' own GetStats (num_finished).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from tests.serving.certs import CertAuthority, CertFiles
from tests.system.conftest import (
    MODEL,
    HttpServer,
    Proc,
    free_port,
    wait_for,
    write_config,
)
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.grpc.auth import DEFAULT_TOKEN_ENV

TOKEN = "workers-test-token-0123456789abcdef"


@dataclass(frozen=True)
class Pki:
    ca: Path
    worker: CertFiles   # both workers' server certificate
    client: CertFiles   # the front end's and this test's client certificate

    def client_credentials(self, token: str | None = TOKEN) -> grpc.ChannelCredentials:
        tls = grpc.ssl_channel_credentials(self.ca.read_bytes(), self.client.key.read_bytes(),
                                           self.client.cert.read_bytes())
        if token is None:
            return tls
        return grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(token))


class Worker(Proc):
    def __init__(self, name: str, config: Path, port: int, log_dir: Path, pki: Pki):
        super().__init__(name, ["worker", "--config", str(config), "--model", MODEL,
                                "--host", "127.0.0.1", "--port", str(port),
                                "--tls-cert", str(pki.worker.cert),
                                "--tls-key", str(pki.worker.key), "--tls-client-ca", str(pki.ca)],
                         log_dir, env={DEFAULT_TOKEN_ENV: TOKEN})
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.secure_channel(self.address, pki.client_credentials())
        self.stub = pb_grpc.GenerationStub(self.channel)

    def stats(self) -> pb.EngineStats:
        return self.stub.GetStats(pb.GetStatsRequest(model=MODEL), timeout=5)

    def is_ready(self) -> bool:
        if not self.alive:
            self.fail("exited before it was ready")
        try:
            return self.stats().ready
        except grpc.RpcError:
            return False

    def idle(self) -> bool:
        s = self.stats()
        return s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0

    def stop(self) -> int:
        self.channel.close()
        return super().stop()


class Cluster:
    def __init__(self, workers: list[Worker], router: HttpServer, pki: Pki):
        self.workers = workers
        self.router = router
        self.pki = pki
        self.client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=60)

    def finished(self) -> list[int]:
        return [w.stats().num_finished for w in self.workers if w.alive]

    def served_by(self, fn) -> tuple[list[int], object]:
        """Run fn(); return how many requests each worker finished meanwhile, and fn's result."""
        before = self.finished()
        out = fn()
        assert wait_for(lambda: all(w.idle() for w in self.workers if w.alive), 10)
        return [b - a for a, b in zip(before, self.finished())], out


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    d = tmp_path_factory.mktemp("cluster")
    ca = CertAuthority(d, "ca")
    pki = Pki(ca.cert, ca.issue("worker", server=True), ca.issue("front", server=False))
    wcfg = write_config("worker.toml", d / "worker.toml", model_dir=model_dir)
    procs: list[Proc] = []
    try:
        workers = [Worker(f"worker-{x}", wcfg, free_port(), d, pki) for x in "ab"]
        procs += workers
        for w in workers:  # both start at once; the second finds the first's compiled buckets
            if not wait_for(w.is_ready, 300, 0.25):
                w.fail("not ready")
        port = free_port()
        rcfg = write_config("router.toml", d / "router.toml", port=port, model_dir=model_dir,
                            worker_a=workers[0].port, worker_b=workers[1].port, tls_ca=pki.ca,
                            tls_cert=pki.client.cert, tls_key=pki.client.key)
        router = HttpServer("router", rcfg, port, d, env={DEFAULT_TOKEN_ENV: TOKEN})
        procs.append(router)
        yield Cluster(workers, router.wait_ready(60), pki)
        assert router.alive, router.log_tail()
    finally:
        codes = {p.name: p.stop() for p in procs}
    # a clean exit on SIGTERM, but for the worker the last test SIGKILLed
    assert sorted(codes.values()) in ([-9, 0, 0], [0, 0, 0]), codes


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_grpc_streams_the_tokens_http_returns_for_the_same_seed(cluster, tokenizer):
    messages = chat("Write a haiku about the sea.")
    r = cluster.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                               temperature=0.8, seed=7, logprobs=True)
    http_tokens = [e.token for e in r.choices[0].logprobs.content]
    prompt = tokenizer.encode_chat(messages)
    for w in cluster.workers:   # either replica: the same tokens
        msgs = list(w.stub.Generate(pb.GenerateRequest(
            model=MODEL, prompt_token_ids=prompt, sampling=pb.SamplingParams(
                max_tokens=16, temperature=0.8, seed=7, logprobs=0)), timeout=60))
        ids = [t for m in msgs for t in m.token_ids]
        assert len(msgs) >= len(ids) > 1        # streamed, not one message at the end
        assert [tokenizer.decode([t], skip_special_tokens=False) for t in ids] == http_tokens
        assert "".join(m.text for m in msgs) == r.choices[0].message.content
        assert msgs[-1].finish_reason == r.choices[0].finish_reason
        assert msgs[-1].usage.completion_tokens == len(ids) == r.usage.completion_tokens
        assert msgs[-1].usage.prompt_tokens == len(prompt) == r.usage.prompt_tokens
        assert [lp.token_id for m in msgs for lp in m.logprobs] == ids


def test_a_worker_turns_away_callers_without_the_token_or_tls(cluster):
    w = cluster.workers[0]
    request = pb.GetStatsRequest(model=MODEL)
    with grpc.secure_channel(w.address, cluster.pki.client_credentials(token=None)) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationStub(ch).GetStats(request, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(w.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationStub(ch).GetStats(request, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_deadline_aborts_and_frees_blocks(cluster, tokenizer):
    """The deadline is relative to this box's speed: the time a first token takes here (the
    same prompt, one token) thrice, plus 20 decode steps, far below the 400 the call asks."""
    w = cluster.workers[0]
    assert wait_for(w.idle, 10)
    prompt = tokenizer.encode_chat(chat("Count from 1 to 300."))
    start = time.monotonic()
    list(w.stub.Generate(pb.GenerateRequest(model=MODEL, prompt_token_ids=prompt,
                                            sampling=pb.SamplingParams(max_tokens=1)),
                         timeout=120))
    first_token_s, step_s = time.monotonic() - start, w.stats().step_s
    deadline = 3 * first_token_s + 20 * step_s
    assert step_s > 0 and 400 * step_s > 2 * deadline, (first_token_s, step_s)
    assert wait_for(w.idle, 10)
    call = w.stub.Generate(pb.GenerateRequest(
        model=MODEL, request_id="deadline-1", prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)),
        timeout=deadline)
    got, used = 0, 0
    with pytest.raises(grpc.RpcError) as e:
        for m in call:
            got += len(m.token_ids)
            if got == 1:
                used = w.stats().kv_blocks_used
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < got < 400 and used > 0
    t0 = time.monotonic()
    assert wait_for(w.idle, 5)
    assert time.monotonic() - t0 < 3


QUESTIONS = ["What is the capital of France?", "Name a large planet.", "What colour is grass?",
             "How many legs does a spider have?", "What do bees make?",
             "Which ocean is the largest?"]


def test_load_spreads_over_both_replicas(cluster):
    def run() -> list[str]:
        return [cluster.client.chat.completions.create(
            model=MODEL, messages=chat(q), max_tokens=4, temperature=0).choices[0].finish_reason
            for q in QUESTIONS]

    per_worker, reasons = cluster.served_by(run)
    assert set(reasons) <= {"stop", "length"}
    assert sum(per_worker) == len(QUESTIONS)
    assert all(n >= 1 for n in per_worker), per_worker


def test_shared_prefix_conversation_sticks_to_one_replica(cluster):
    messages = [{"role": "system", "content":
                 "You are a patient geography tutor. Answer in one short sentence, name the "
                 "country or city asked about, and do not add any other remarks, lists, or "
                 "follow-up questions. Keep every answer under twenty words."}]
    cached = []

    def turn(question: str) -> None:
        messages.append({"role": "user", "content": question})
        r = cluster.client.chat.completions.create(model=MODEL, messages=messages,
                                                   max_tokens=8, temperature=0)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)

    counts = [cluster.served_by(lambda q=q: turn(q))[0]
              for q in ("What is the capital of France?", "And of Italy?", "And of Spain?")]
    (where,) = {tuple(c) for c in counts}  # every turn on the same replica
    assert sorted(where) == [0, 1]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached


SHORT_CHATS = [("What is the capital of France?", "And of Italy?"),
               ("Name a large planet.", "And a small one?"), ("What do bees make?", "Why?"),
               ("What colour is grass?", "And the sky?"), ("How many legs has a cat?", "A bird?"),
               ("Which ocean is the largest?", "The smallest?"), ("Say hi.", "Again."),
               ("What is 2+2?", "And 3+3?"), ("Name a fruit.", "Another."),
               ("What is ice?", "And steam?")] * 2


def test_short_two_turn_chats_keep_their_replica_and_their_cache(cluster, tokenizer):
    """20 short conversations under the default system prompt, every first turn before any
    second: each second turn (whose prompt is longer than its first by the answer and a new
    question) lands where its first turn ran, and finds that turn's prompt in its cache."""
    def turn(messages: list[dict[str, str]]) -> object:
        return cluster.client.chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=8, temperature=0)

    conversations, first_on = [], []
    for i, (q1, _) in enumerate(SHORT_CHATS):
        messages = chat(f"{q1} ({i})")
        per_worker, r = cluster.served_by(lambda m=messages: turn(m))
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        conversations.append(messages)
        first_on.append(per_worker.index(1))
    assert set(first_on) == {0, 1}, first_on     # new conversations spread over both
    for messages, (_, q2), where in zip(conversations, SHORT_CHATS, first_on):
        first_prompt = len(tokenizer.encode_chat(messages[:1]))
        messages.append({"role": "user", "content": q2})
        per_worker, r = cluster.served_by(lambda m=messages: turn(m))
        assert per_worker.index(1) == where, (messages, per_worker, where)
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached >= first_prompt // 16 * 16, (messages, cached)


def test_client_disconnect_at_the_router_frees_the_workers_blocks(cluster):
    """Closing an HTTP stream at the front end cancels the gRPC call; the worker aborts."""
    assert wait_for(lambda: all(w.idle() for w in cluster.workers), 10)
    with httpx.stream("POST", cluster.router.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": chat("Count from 1 to 300."), "max_tokens": 300,
            "temperature": 0, "stream": True}) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines >= 4:   # the role chunk and three tokens
                break
        used = [w.stats().kv_blocks_used for w in cluster.workers]
        assert sum(used) > 0 and 0 in used   # on exactly one worker
    t0 = time.monotonic()
    assert wait_for(lambda: all(w.idle() for w in cluster.workers), 5)
    assert time.monotonic() - t0 < 3


def has_content(events: list[dict]) -> bool:
    return any(c.get("delta", {}).get("content") for e in events for c in e.get("choices", []))


def stream(router: HttpServer, content: str, events: list[dict], errors: list[Exception]
           ) -> None:
    """Stream one chat completion over raw SSE, appending its events to `events` as they come
    ({"done": True} for [DONE]); an exception goes to `errors`."""
    try:
        with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": chat(content), "max_tokens": 24,
                "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    events.append({"done": True})
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    except Exception as e:  # noqa: BLE001 (checked by the test)
        errors.append(e)


def test_sigkill_of_a_replica_fails_its_requests_explicitly_and_routes_to_the_survivor(
        cluster):
    # Three of these extend a prompt one replica ran, one a prompt the other ran: by their
    # prefixes three go to one (it runs two, the third waits there), one to the other.
    lead = {}
    for k in range(8):
        intro = (f"Conversation {k}: you are a counting machine, and you print numbers, "
                 "one per line, with nothing else at all, until you are told to stop.")
        per_worker, _ = cluster.served_by(lambda m=chat(intro): cluster.client.chat.completions
                                          .create(model=MODEL, messages=m, max_tokens=1))
        lead.setdefault(per_worker.index(1), intro)
        if len(lead) == 2:
            break
    assert len(lead) == 2, "every conversation went to one replica"
    prompts = [f"{lead[0]} Count from {i} to {i + 300}." for i in (1, 2, 3)]
    prompts.append(f"{lead[1]} Count from 5 to 305.")
    results: list[list[dict]] = [[] for _ in prompts]
    failures: list[Exception] = []
    threads = [threading.Thread(target=stream, args=(cluster.router, p, results[i], failures))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()

    def settled() -> bool:
        """All four in the workers, and every running one has streamed a token (waiting ones
        cannot have: all four started together)."""
        stats = [w.stats() for w in cluster.workers]
        running = sum(s.num_running for s in stats)
        return (sum(s.num_running + s.num_waiting for s in stats) == 4
                and running == sum(has_content(list(ev)) for ev in results) > 0)

    assert wait_for(settled, 30, 0.02)
    stats = [w.stats() for w in cluster.workers]
    assert sorted((s.num_running, s.num_waiting) for s in stats) == [(1, 0), (2, 1)]
    victim_i = 0 if stats[0].num_waiting else 1   # the one with a request yet to start
    victim, survivor = cluster.workers[victim_i], cluster.workers[1 - victim_i]
    before = survivor.stats().num_finished
    t_kill = time.monotonic()
    victim.kill()

    # new requests at once, the killed replica's preferred prefixes among them: all served
    for q in QUESTIONS[:4]:
        r = cluster.client.chat.completions.create(model=MODEL, messages=chat(q),
                                                   max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures
    assert time.monotonic() - t_kill < 45

    errored = 0
    for events in results:
        assert events[-1] == {"done": True}       # every stream ends properly
        errors = [e["error"] for e in events if "error" in e]
        finishes = [c["finish_reason"] for e in events for c in e.get("choices", [])
                    if c.get("finish_reason")]
        if errors:
            errored += 1
            (err,) = errors
            assert err["code"] == "engine_error" and victim.address in err["message"], err
            assert not finishes
            assert has_content(events)  # tokens were sent: too late to retry elsewhere
        else:
            assert finishes in (["stop"], ["length"]), events[-3:]
    # the victim's two running requests (streaming already) failed; its waiting one moved to
    # the survivor, where everything else finished
    assert errored == stats[victim_i].num_running == 2
    assert survivor.stats().num_finished - before == len(prompts) - errored + 4
    assert wait_for(survivor.idle, 10)
    assert cluster.router.alive
    assert httpx.get(cluster.router.url + "/health", timeout=5).status_code == 200
    assert httpx.get(cluster.router.url + "/ready", timeout=5).status_code == 200
