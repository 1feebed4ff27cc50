"""`bench online` against the FakeEngine behind the real HTTP server (the front-end fixtures of
tests/serving/front): timings the fake engine sets by hand (a first token after prefill_delay +
token_delay, then one every token_delay), exact token counts, counts that add up, goodput that
follows the SLO, failures counted by status, and the CLI's table, JSON and PNG."""

from __future__ import annotations

import asyncio
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.serving.live_server import free_port
from xlaserve.bench.online import (
    OnlineOptions,
    parse_rates,
    poisson_arrivals,
    run_rate,
    run_sweep,
    text_requests,
)
from xlaserve.bench.online_report import SLO, summarize
from xlaserve.bench.stream_client import Endpoint, TextRequest
from xlaserve.serving.server_config import AdmissionConfig, ServedModel, ServerConfig

PREFILL, TOKEN = 0.05, 0.03          # the fake engine's delays, seconds
METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def endpoint(srv, **kw) -> Endpoint:
    return Endpoint(base_url=srv.url + "/v1", model="fake", **kw)


def assert_counts_add_up(s: dict) -> None:
    assert s["sent"] == s["completed"] + s["failed"] == sum(s["statuses"].values())
    assert s["completed"] == s["statuses"].get("ok", 0)
    assert len(s["requests"]) == s["sent"]
    assert s["failed"] == sum(r["status"] != "ok" for r in s["requests"])


def test_sweep_of_two_rates(make_server, tokenizer) -> None:
    srv = make_server(token_delay=TOKEN, prefill_delay=PREFILL)
    requests, workload = text_requests("tiny", tokenizer, seed=0, num_requests=15)
    assert workload["num_requests"] == 15 and workload["prompt_units"] == "tokens"
    options = OnlineOptions(workload="tiny", rates=(8.0, 16.0), num_requests=15)
    results = run_sweep(endpoint(srv), requests, options)

    assert [s["rate"] for s in results] == [8.0, 16.0]
    for s in results:
        assert_counts_add_up(s)
        assert s["statuses"] == {"ok": 15} and s["unsent"] == 0
        assert s["usage_reported"] == 15
        # the fake engine echoes the reversed prompt (no EOS in it): exactly max_tokens each
        by_id = {r["request_id"]: r for r in s["requests"]}
        for req in requests:
            rec = by_id[req.request_id]
            assert rec["output_tokens"] == req.max_tokens
            assert rec["text_chunks"] == req.max_tokens      # one SSE chunk per token
            assert len(rec["itl_s"]) == req.max_tokens - 1
            assert rec["latency_s"] >= PREFILL + req.max_tokens * TOKEN
        assert s["output_tokens"] == sum(r.max_tokens for r in requests)
        assert s["request_throughput"] == pytest.approx(15 / s["wall_s"])
        assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
        for m in METRICS:
            d = s[m]
            assert d["p50"] <= d["p90"] <= d["p99"], (m, d)
        assert s["ttft_s"]["n"] == 15 and s["e2e_s"]["n"] == 15
        assert s["itl_s"]["n"] == sum(r.max_tokens - 1 for r in requests)
        # timings the fake engine dictates: never faster than its delays; how much slower
        # a loaded 2-core box makes them is no claim of the client's, but the two ways of
        # measuring a token's time (each gap; a request's decode time over its tokens) agree
        assert PREFILL + TOKEN <= s["ttft_s"]["p50"]
        assert TOKEN * 0.9 <= s["itl_s"]["p50"] and TOKEN * 0.9 <= s["tpot_s"]["p50"]
        assert s["itl_s"]["p50"] == pytest.approx(s["tpot_s"]["p50"], rel=0.25)
        assert s["ttft_s"]["p50"] < s["e2e_s"]["p50"]
        # sent on the seeded Poisson schedule, never early, late only by the client's lag
        planned = poisson_arrivals(15, s["rate"], options.seed)
        assert [by_id[r.request_id]["scheduled_s"] for r in requests] == list(planned)
        lag = np.array([r["sent_s"] - r["scheduled_s"] for r in s["requests"]])
        assert lag.min() >= -1e-3 and np.median(lag) < 0.05 and lag.max() < 1.0, lag
        assert s["goodput"]["fraction"] == 1.0    # default SLO: 1 s TTFT, 0.2 s TPOT
    json.dumps(results, allow_nan=False)          # the records serialise as strict JSON


def test_goodput_follows_the_slo(make_server, tokenizer) -> None:
    srv = make_server(token_delay=TOKEN, prefill_delay=PREFILL)
    requests, _ = text_requests("tiny", tokenizer, seed=1, num_requests=10)
    options = OnlineOptions(workload="tiny", rates=(20.0,), progress=False)
    records, wall, unsent = asyncio.run(run_rate(endpoint(srv), requests, 20.0, options))
    assert unsent == 0 and all(r.ok for r in records)

    def goodput(ttft: float, tpot: float) -> float:
        return summarize(20.0, records, wall, SLO(ttft, tpot))["goodput"]["fraction"]

    loose, tight = goodput(10.0, 10.0), goodput(PREFILL / 2, 10.0)
    assert loose == 1.0 and tight == 0.0
    mid_ttft = float(np.median([r.ttft_s for r in records]))
    assert tight < goodput(mid_ttft, 10.0) < loose
    # a TPOT no streamed token can meet: only the one-token answers (no TPOT) pass
    one_token = sum(r.output_tokens == 1 for r in records)
    assert one_token >= 1       # the workload pins its second request to the shortest output
    assert goodput(10.0, TOKEN / 10) == one_token / len(records)
    s = summarize(20.0, records, wall, SLO(PREFILL / 2, 10.0))
    assert s["goodput"]["requests"] == 0 and s["goodput"]["rate_per_s"] == 0.0


def test_overloaded_server_429s_are_counted(make_server, tokenizer) -> None:
    cfg = ServerConfig(models=(ServedModel("fake", max_inflight=2, max_queue=4),),
                       admission=AdmissionConfig(slo_wait_s={"internal": 1.0}))
    srv = make_server(cfg, token_delay=0.02)
    requests, _ = text_requests("tiny", tokenizer, seed=0, num_requests=15)
    options = OnlineOptions(workload="tiny", rates=(math.inf,), slo=SLO(10.0, 10.0))
    [s] = run_sweep(endpoint(srv), requests, options)
    assert_counts_add_up(s)
    assert s["sent"] == 15
    assert set(s["statuses"]) == {"ok", "http_429"}, s["statuses"]
    assert s["statuses"]["http_429"] >= 1 and s["statuses"]["ok"] >= 2
    for r in s["requests"]:
        if r["status"] == "http_429":
            assert r["error"] and r["latency_s"] is None and r["output_tokens"] == 0
    # loose SLO: goodput is exactly the completed share, failures count against it
    assert s["goodput"]["fraction"] == s["completed"] / s["sent"] < 1.0
    assert s["ttft_s"]["n"] == s["completed"]


def test_timeouts_are_counted(make_server, tokenizer) -> None:
    srv = make_server(token_delay=0.1)
    slow = [TextRequest(f"slow-{i}", "one two three four five six", 12) for i in range(3)]
    options = OnlineOptions(workload="tiny", rates=(math.inf,), progress=False)
    records, _, _ = asyncio.run(run_rate(endpoint(srv, timeout_s=0.3), slow, math.inf,
                                         options))
    assert [r.status for r in records] == ["timeout"] * 3
    assert all(r.latency_s is None for r in records)
    s = summarize(math.inf, records, 0.3, SLO())
    assert s["statuses"] == {"timeout": 3} and s["completed"] == 0


def test_refused_connection_is_counted() -> None:
    port = free_port()        # nothing listens there
    ep = Endpoint(base_url=f"http://127.0.0.1:{port}/v1", model="fake", timeout_s=5)
    options = OnlineOptions(workload="tiny", rates=(math.inf,), progress=False)
    records, _, _ = asyncio.run(run_rate(ep, [TextRequest("r", "hi", 2)], math.inf, options))
    assert records[0].status == "connect_error"
    s = summarize(math.inf, records, 0.01, SLO())
    assert s["failed"] == 1 and s["statuses"] == {"connect_error": 1}
    assert s["ttft_s"]["p50"] is None and s["goodput"]["fraction"] == 0.0


def test_chat_counts_usage_tokens_and_skips_the_role_chunk(make_server, tokenizer) -> None:
    srv = make_server(token_delay=0.01)
    reqs = [TextRequest("c0", "Tell me about lighthouses.", 5)]
    options = OnlineOptions(workload="tiny", rates=(math.inf,), progress=False)
    for include_usage in (True, False):
        ep = endpoint(srv, kind="chat", include_usage=include_usage)
        [r], _, _ = asyncio.run(run_rate(ep, reqs, math.inf, options))
        assert r.ok and r.usage_reported == include_usage
        assert r.ttft_s is not None and r.text_chunks >= 1
        assert len(r.itl_s) == r.text_chunks - 1
        if include_usage:
            # the echo meets the template's <|im_end|> (EOS) within a few tokens; a special
            # token streams no text, so usage may count more tokens than text chunks
            assert 1 <= r.output_tokens <= 5 and r.output_tokens >= r.text_chunks
        else:
            assert r.output_tokens == r.text_chunks


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_cli_table_json_png_and_duration(make_server, tmp_path, capsys) -> None:
    from xlaserve.cli import main

    srv = make_server(token_delay=0.01)
    out, png = tmp_path / "online.json", tmp_path / "online.png"
    rc = main(["bench", "online", "--url", srv.url + "/v1", "--model", "fake",
               "--workload", "tiny", "--rates", "4,inf", "--num-requests", "10",
               "--duration", "1.0", "--slo-ttft", "2", "--slo-tpot", "0.5",
               "--json", str(out), "--plot", str(png), "--api-key", "sk-test"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT p50/p99 ms" in printed and "| inf " in printed and "sk-test" not in printed
    report = json.loads(out.read_text())
    assert report["workload"]["prompt_units"] == "words"    # no --tokenizer: corpus words
    assert report["slo"] == {"ttft_s": 2.0, "tpot_s": 0.5, "e2el_s": None}
    assert report["endpoint"]["api_key"] == "set"
    assert [s["rate"] for s in report["rates"]] == [4.0, "inf"]
    for s in report["rates"]:
        assert_counts_add_up(s)
        assert s["statuses"] == {"ok": s["sent"]}
        assert set(METRICS) <= set(s) and set(s["goodput"]) == {
            "ttft_s", "tpot_s", "e2el_s", "requests", "fraction", "rate_per_s"}
    # --duration 1.0: at 4 req/s only the arrivals before 1 s are sent; a burst sends all
    at4, burst = report["rates"]
    assert at4["sent"] == int((poisson_arrivals(10, 4.0, 0) < 1.0).sum()) < 10
    assert at4["sent"] + at4["unsent"] == 10
    assert burst["sent"] == 10 and burst["unsent"] == 0
    assert png_size(png) == (1200, 700)
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (700, 1200)


def test_option_errors_name_the_values() -> None:
    assert parse_rates("0.5,1, 2") == (0.5, 1.0, 2.0)
    assert parse_rates("inf") == (math.inf,)
    with pytest.raises(ValueError, match="fast"):
        parse_rates("1,fast")
    with pytest.raises(ValueError, match="-1"):
        OnlineOptions(workload="tiny", rates=(-1.0,))
    with pytest.raises(ValueError, match="nope"):
        OnlineOptions(workload="nope")
    with pytest.raises(ValueError, match="ftp://x"):
        Endpoint(base_url="ftp://x", model="m")
    with pytest.raises(ValueError, match="0"):
        SLO(0.0, 1.0)
