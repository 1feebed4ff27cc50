"""Prefill and decode on separate `xlaserve worker` processes (serving/disagg/): two prefill
workers and a decode worker, started by an `xlaserve serve` front end as its children
(configs/disagg.toml: spawn_workers, as the smollm2-disagg preset), every hop carrying the
bearer token:

- greedy token ids through prefill worker -> KV over gRPC -> decode worker equal the unified
  engine's (the decode worker serving whole requests, as any worker does) for the 8-prompt
  parity set and a 32-request mixed workload sent at once; the decode worker's prefix cache
  shows the prompts' blocks arriving instead of being computed, all of them by the prefetch
  that follows the prefill;
- an ExportKV following a running prefill streams its first blocks before the prefill ends,
  every full block once, in order;
- a client gone during prefill or during decode leaves every worker idle with every block
  free; so does an Abort or a cancelled call while the decode worker fetches the KV (its
  source SIGSTOPped to hold the transfer open);
- a prompt whose long prefix was prefilled before goes back to that prefill worker (its
  prefix hits rise), unrelated prompts spread over both;
- a prefill worker SIGKILLed mid-request: the request is retried on the other one; a decode
  worker SIGKILLed mid-request: an explicit error naming it, never a hang; the front end
  stays up and the workers left end idle.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from tests.system.conftest import MODEL, HttpServer, free_port, wait_for, write_config
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.grpc.auth import DEFAULT_TOKEN_ENV

pytestmark = pytest.mark.slow
TOKEN = "disagg-test-token-0123456789abcdef"
LENGTHS = (17, 40, 64, 95, 128, 161, 230, 300)
KV_BYTES = 30 * 3 * 64 * 4   # one token's K (or V) in SmolLM2's float32 cache: L x K x D x 4


class Worker:
    """A worker the front end spawned, reached over gRPC with the token."""

    def __init__(self, port: int):
        self.port = port
        self.target = f"127.0.0.1:{port}"
        self.channel = grpc.secure_channel(
            f"127.0.0.1:{port}", grpc.composite_channel_credentials(
                grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP),
                grpc.access_token_call_credentials(TOKEN)))
        self.stub = pb_grpc.GenerationStub(self.channel)

    def pid(self) -> int:
        """Its process, found by its command line (`... worker ... --port P ...`)."""
        for d in Path("/proc").iterdir():
            try:
                args = (d / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if b"worker" in args and str(self.port).encode() in args and d.name.isdigit():
                return int(d.name)
        raise LookupError(f"no worker process on port {self.port}")

    def stats(self) -> pb.EngineStats:
        return self.stub.GetStats(pb.GetStatsRequest(model=MODEL), timeout=5)

    def idle(self) -> bool:
        s = self.stats()
        return s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0

    def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        """A whole greedy request on this worker alone: the unified engine's tokens (under a
        tenant of its own, so that it never reads KV a split request brought)."""
        req = pb.GenerateRequest(model=MODEL, prompt_token_ids=ids, tenant="unified",
                                 sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True))
        return [t for m in self.stub.Generate(req, timeout=120) for t in m.token_ids]


class Split:
    def __init__(self, prefills: list[Worker], decode: Worker, front: HttpServer):
        self.prefills, self.decode, self.front = prefills, decode, front
        self.live = [*prefills, decode]   # the workers not killed by a test

    def complete(self, ids: list[int], max_tokens: int) -> list[int]:
        """Greedy token ids through the split, read back from the completion's logprobs
        (`return_tokens_as_token_ids`: "token_id:<id>")."""
        r = httpx.post(self.front.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert all(t.startswith("token_id:") for t in tokens), tokens
        return [int(t.removeprefix("token_id:")) for t in tokens]

    def idle(self) -> bool:
        return all(w.idle() for w in self.live)

    def stats(self) -> list[pb.EngineStats]:
        return [w.stats() for w in self.live]

    def kill(self, worker: Worker) -> None:
        os.kill(worker.pid(), signal.SIGKILL)
        self.live.remove(worker)


@pytest.fixture(scope="module")
def split(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    d = tmp_path_factory.mktemp("disagg")
    ports = {"prefill": free_port(), "prefill2": free_port(), "decode": free_port(),
             "port": free_port()}
    cfg = write_config("disagg.toml", d / "disagg.toml", model_dir=model_dir, **ports)
    front = HttpServer("front-disagg", cfg, ports["port"], d, env={DEFAULT_TOKEN_ENV: TOKEN})
    try:
        front.wait_ready()    # once both workers it started are warm
        yield Split([Worker(ports["prefill"]), Worker(ports["prefill2"])],
                    Worker(ports["decode"]), front)
        assert front.alive, front.log_tail()
    finally:
        code = front.stop()
    assert code == 0, front.log_tail()
    workers_left = [p for p in ("prefill", "prefill2", "decode") if _alive(ports[p])]
    assert not workers_left, f"{workers_left} workers outlived the server"


def _alive(port: int) -> bool:
    try:
        Worker(port).pid()
    except LookupError:
        return False
    return True


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    text = " ".join(p.read_text() for p in sorted(Path("xlaserve/serving").glob("*.py")))
    ids = tokenizer.encode(text)
    rng = np.random.default_rng(18)
    out = []
    for n in LENGTHS:
        start = int(rng.integers(0, len(ids) - n))
        out.append(ids[start:start + n])
    return out


def test_split_tokens_equal_the_unified_engine(split, prompts):
    before = split.decode.stats()
    got = [split.complete(p, 12) for p in prompts]
    # each prompt's full blocks came over from the prefill worker: prefix hits on the decode
    # side, not computed there; every one by the prefetch while the prompt prefilled, none by
    # the decode part's own fetch
    after = split.decode.stats()
    came = after.prefix_cache_hits - before.prefix_cache_hits
    assert came == sum(len(p) // 16 * 16 for p in prompts), came
    assert after.kv_blocks_prefetched - before.kv_blocks_prefetched == came // 16, after
    assert after.kv_blocks_fetched == before.kv_blocks_fetched, after
    for p, tokens in zip(prompts, got):
        assert tokens == split.decode.generate(p, 12), len(p)
    assert wait_for(split.idle, 10)
    # the front end's /metrics: one transfer per request, bytes = the blocks' K and V
    assert split.front.metric("xlaserve_kv_transfer_seconds_count") == len(prompts)
    assert split.front.metric("xlaserve_kv_transfer_bytes_total") == 2 * came * KV_BYTES


def test_32_requests_at_once_equal_the_unified_engine(split, prompts):
    rng = np.random.default_rng(32)
    work = [(prompts[i % 8][: int(rng.integers(8, len(prompts[i % 8]) + 1))],
             int(rng.integers(1, 24))) for i in range(32)]
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        got[i] = split.complete(*work[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (p, n) in enumerate(work):
        assert got.get(i) == split.decode.generate(p, n), (i, len(p), n)
    assert wait_for(split.idle, 10)


def test_a_followed_export_streams_blocks_while_the_prompt_prefills(split, prompts):
    """ExportKV following a request, called before the request reaches the prefill worker:
    the first blocks come while its prefill (four chunks of 128) still runs, then the rest,
    each block once, in order; a follow of the request once it has ended sends what is
    cached at once."""
    source, ids = split.prefills[0], [t for p in prompts[4:] for t in p][:500]
    follow = pb.ExportKVRequest(model=MODEL, prompt_token_ids=ids, follow_request_id="follow")
    stream = source.stub.ExportKV(follow, timeout=60)
    done = threading.Event()

    def prefill() -> None:
        part = pb.GenerateRequest(model=MODEL, prompt_token_ids=ids, request_id="follow",
                                  continues=True,
                                  sampling=pb.SamplingParams(max_tokens=1, ignore_eos=True))
        list(source.stub.Generate(part, timeout=60))
        done.set()

    t = threading.Thread(target=prefill)
    t.start()
    got = [(m.first_block, m.shape[1], done.is_set()) for m in stream]
    t.join(60)
    assert not got[0][2], got                        # before the prefill's last chunk
    starts = [0, *np.cumsum([n for _, n, _ in got])]
    assert [first for first, _, _ in got] == starts[:-1] and starts[-1] == len(ids) // 16, got
    again = list(source.stub.ExportKV(follow, timeout=60))
    assert sum(m.shape[1] for m in again) == len(ids) // 16
    assert wait_for(split.idle, 10), split.stats()


def _stream_then_drop(split: Split, ids: list[int], after_chunks: int) -> None:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", split.front.url + "/v1/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                if chunks >= after_chunks:
                    break   # the client goes away mid-stream


def _send_then_close(split: Split, body: dict, until: Callable[[], bool]) -> None:
    """POST `body` on a raw connection and close it, unread, once `until()` holds."""
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", split.front.port))
    try:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(data) + data)
        assert wait_for(until, 30, interval=0.005), split.stats()
    finally:
        conn.close()


def test_client_gone_in_decode_or_prefill_frees_every_block(split, prompts):
    _stream_then_drop(split, prompts[-1], after_chunks=5)          # in decode
    assert wait_for(split.idle, 20), split.stats()
    # gone before the first token: once a prefill worker runs the prompt (4 chunks of 128),
    # and before the decode part reached the decode worker's engine
    long_prompt = [t for p in prompts[4:] for t in p][:480]
    decoded = split.decode.stats().num_finished
    _send_then_close(split, {"model": MODEL, "prompt": long_prompt, "max_tokens": 20,
                             "stream": True},
                     until=lambda: any(w.stats().num_running for w in split.prefills))
    assert wait_for(split.idle, 30), split.stats()
    assert split.decode.stats().num_finished == decoded   # it never got to decode


def _finished(workers: list[Worker]) -> list[tuple[int, int]]:
    return [(s.num_finished, s.prefix_cache_hits) for s in (w.stats() for w in workers)]


def test_a_repeated_prefix_goes_to_the_prefill_worker_holding_it(split, prompts):
    shared = prompts[-1][:240]                         # 15 blocks, prefilled by earlier tests
    tails = [list(reversed(p))[:20] for p in prompts[:4]]
    before = _finished(split.prefills)
    for tail in tails:
        split.complete(shared + tail, 2)
    after = _finished(split.prefills)
    runs = [a[0] - b[0] for a, b in zip(after, before)]
    hits = [a[1] - b[1] for a, b in zip(after, before)]
    assert sorted(runs) == [0, 4], (runs, hits)        # all four on one worker
    held = runs.index(4)
    assert hits[held] >= 3 * 240 and hits[1 - held] == 0, hits
    # unrelated prompts (no remembered prefix): the least loaded, ties in turn
    before = _finished(split.prefills)
    for p in prompts[4:]:
        split.complete(list(reversed(p)), 2)
    runs = [a[0] - b[0] for a, b in zip(_finished(split.prefills), before)]
    assert sum(runs) == 4 and min(runs) >= 1, runs
    assert wait_for(split.idle, 10), split.stats()


def test_abort_or_cancel_while_the_kv_is_fetched_frees_everything(split, prompts):
    """The split's middle driven over gRPC as the front end drives it: the prefill part on a
    prefill worker, which is then SIGSTOPped, so that two decode parts sent after it stay in
    their KV fetch; one gets an Abort, the other's call is cancelled (the front end's client
    gone)."""
    source, decode, ids = split.prefills[0], split.decode, prompts[-2]
    prefill_part = pb.GenerateRequest(
        model=MODEL, prompt_token_ids=ids, request_id="fetch-p", continues=True,
        sampling=pb.SamplingParams(max_tokens=1, ignore_eos=True))
    first = [t for m in source.stub.Generate(prefill_part, timeout=60) for t in m.token_ids]

    def decode_part(rid: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(model=MODEL, prompt_token_ids=ids, request_id=rid,
                                  output_token_ids=first, kv_source=source.target,
                                  sampling=pb.SamplingParams(max_tokens=50, ignore_eos=True))

    os.kill(source.pid(), signal.SIGSTOP)
    try:
        aborted = decode.stub.Generate(decode_part("fetch-a"), timeout=60)
        cancelled = decode.stub.Generate(decode_part("fetch-c"), timeout=60)
        assert wait_for(lambda: decode.stats().kv_fetching == 2, 30), decode.stats()
        decode.stub.Abort(pb.AbortRequest(model=MODEL, request_id="fetch-a"), timeout=5)
        ends = [(m.finish_reason, list(m.token_ids)) for m in aborted]
        assert ends == [("abort", [])], ends
        cancelled.cancel()
        assert wait_for(lambda: decode.stats().kv_fetching == 0, 10), decode.stats()
        assert decode.idle(), decode.stats()              # neither reached its engine
    finally:
        os.kill(source.pid(), signal.SIGCONT)
    assert wait_for(split.idle, 30), split.stats()         # the ExportKV calls it resumes to
    # both ids are free again on the decode worker: a whole request reusing one runs
    again = pb.GenerateRequest(model=MODEL, prompt_token_ids=ids[:20], request_id="fetch-c",
                               sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    assert len([t for m in decode.stub.Generate(again, timeout=60) for t in m.token_ids]) == 2
    assert wait_for(split.idle, 10), split.stats()


def test_prefill_worker_killed_mid_request_is_retried_on_the_other(split, prompts):
    long_prompt = [t for p in prompts[4:] for t in p][:480]
    result: dict[str, object] = {}

    def send() -> None:
        r = httpx.post(split.front.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": long_prompt, "max_tokens": 8, "ignore_eos": True})
        result["status"], result["body"] = r.status_code, r.text

    before = _finished(split.prefills)
    t = threading.Thread(target=send)
    t.start()
    running: list[Worker] = []   # the worker seen running it, by the same poll that saw it

    def started() -> bool:
        running.extend(w for w in split.prefills if w.stats().num_running)
        return bool(running)

    assert wait_for(started, 30, interval=0.005)
    victim = running[0]
    split.kill(victim)   # its 4 chunks of 128 take far longer than this poll's few ms
    other = split.prefills[1 - split.prefills.index(victim)]
    t.join(120)
    assert not t.is_alive(), "the request hung after its prefill worker died"
    assert result["status"] == 200, result
    assert json.loads(str(result["body"]))["usage"]["completion_tokens"] == 8, result
    # the other prefill worker ran the prompt again: one more part finished there
    done = before[split.prefills.index(other)][0]
    assert other.stats().num_finished == done + 1
    assert split.front.alive and wait_for(split.idle, 10), split.stats()


def test_decode_worker_killed_mid_request_is_an_explicit_error(split, prompts):
    result: dict[str, object] = {}

    def send() -> None:
        r = httpx.post(split.front.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompts[3], "max_tokens": 300, "ignore_eos": True})
        result["status"], result["body"] = r.status_code, r.text

    t = threading.Thread(target=send)
    t.start()
    assert wait_for(lambda: split.decode.stats().num_running > 0, 60)
    split.kill(split.decode)
    t.join(60)
    assert not t.is_alive(), "the request hung after its decode worker died"
    assert result["status"] >= 500, result
    error = json.loads(str(result["body"]))["error"]
    assert f"decode worker {split.decode.target}" in error["message"], error
    assert split.front.alive and wait_for(split.idle, 10), split.stats()   # the prefill side
    assert httpx.get(split.front.url + "/health", timeout=10).status_code == 200
