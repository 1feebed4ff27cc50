"""`bench online` in `vllm bench serve`'s dialect, against a stand-in OpenAI server that is not
xlaserve (tests/bench/fake_openai_server.py): vLLM's datasets with exact lengths, --goodput,
--max-concurrency with --request-rate inf, --save-result with vLLM's field names and file name,
and the PNG of the TTFT/TPOT/ITL distributions."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from tests.bench.fake_openai_server import FakeOpenAIServer
from xlaserve.bench.datasets import DatasetOptions, build_dataset
from xlaserve.bench.online import CorpusWords
from xlaserve.bench.online_report import SLO

FIRST, TOKEN = 0.05, 0.02   # the fake server's delays, seconds

# what `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py), without
# --save-detailed, for the default --percentile-metrics ttft,tpot,itl plus e2el
VLLM_FIELDS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "latencies", "queue_times", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for s in ("mean", "median", "std", "p99")),
    *(f"{s}_client_queue_time_ms" for s in ("mean", "median", "std", "p99")),
}
DETAILED = {"input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts"}


def test_datasets_have_vllm_shapes_with_exact_token_lengths(tokenizer) -> None:
    rnd = build_dataset(DatasetOptions("random", random_input_len=40, random_output_len=10,
                                       random_range_ratio=0.5, random_prefix_len=16),
                        tokenizer, seed=3, num_prompts=30)
    assert len(rnd) == 30
    prefixes = set()
    for r in rnd:
        ids = tokenizer.encode(r.prompt, add_special_tokens=False)
        assert 16 + 20 <= r.prompt_tokens <= 16 + 60 and 5 <= r.max_tokens <= 15, r
        assert abs(len(ids) - r.prompt_tokens) <= 2   # a decoded window re-encodes ~exactly
        prefixes.add(tuple(ids[:12]))
    assert len(prefixes) == 1                       # --random-prefix-len: one shared prefix
    again = build_dataset(DatasetOptions("random", random_input_len=40, random_output_len=10,
                                         random_range_ratio=0.5, random_prefix_len=16),
                          tokenizer, seed=3, num_prompts=30)
    assert again == rnd                             # seeded

    words = CorpusWords()
    rep = build_dataset(DatasetOptions("prefix_repetition", prefix_repetition_prefix_len=12,
                                       prefix_repetition_suffix_len=5,
                                       prefix_repetition_num_prefixes=4,
                                       prefix_repetition_output_len=7),
                        words, seed=0, num_prompts=14)
    assert len(rep) == 12 and {r.max_tokens for r in rep} == {7}   # 14 // 4 per prefix
    by_prefix: dict[str, list[str]] = {}
    for r in rep:
        w = r.prompt.split()
        assert len(w) == r.prompt_tokens == 17
        by_prefix.setdefault(" ".join(w[:12]), []).append(" ".join(w[12:]))
    assert sorted(len(v) for v in by_prefix.values()) == [3, 3, 3, 3]
    assert len({s for v in by_prefix.values() for s in v}) == 12   # distinct suffixes

    share = build_dataset(DatasetOptions("sharegpt-like"), words, seed=0, num_prompts=400)
    p = [r.prompt_tokens for r in share]
    o = [r.max_tokens for r in share]
    assert min(p) >= 4 and max(p) <= 1024 and min(o) >= 4
    assert all(a + b <= 2048 for a, b in zip(p, o))
    assert sorted(p)[200] < sum(p) / len(p)         # long-tailed: median below the mean
    with pytest.raises(ValueError, match="sharegpt'"):
        DatasetOptions("sharegpt")
    with pytest.raises(ValueError, match="--random-range-ratio 1.5"):
        DatasetOptions(random_range_ratio=1.5)


def test_goodput_pairs_in_milliseconds() -> None:
    slo = SLO.from_goodput(["ttft:500", "tpot:50"])
    assert (slo.ttft_s, slo.tpot_s, slo.e2el_s) == (0.5, 0.05, None)
    assert SLO.from_goodput(["e2el:2000"]) == SLO(None, None, 2.0)
    with pytest.raises(ValueError, match="'itl:5'"):
        SLO.from_goodput(["itl:5"])
    with pytest.raises(ValueError, match="'ttft:fast'"):
        SLO.from_goodput(["ttft:fast"])


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def run_cli(server: FakeOpenAIServer, out: Path, *extra: str) -> dict:
    from xlaserve.cli import main

    rc = main(["bench", "online", "--url", server.url, "--dataset", "random",
               "--random-input-len", "24", "--random-output-len", "6", "--num-prompts", "12",
               "--request-rate", "inf", "--max-concurrency", "4", "--save-result",
               "--result-dir", str(out), "--disable-tqdm", *extra])
    assert rc == 0
    [path] = out.glob("*.json")
    return {"name": path.name, **json.loads(path.read_text())}


def test_vllm_dialect_against_another_openai_server(tmp_path: Path, capsys) -> None:
    with FakeOpenAIServer(first_delay=FIRST, token_delay=TOKEN) as server:
        png = tmp_path / "online.png"
        r = run_cli(server, tmp_path / "loose", "--goodput", "ttft:10000", "tpot:1000",
                    "--save-detailed", "--plot", str(png), "--metadata", "run=ci")
        tight = run_cli(server, tmp_path / "tight", "--goodput", f"ttft:{FIRST * 1e3 / 2}",
                        "--backend", "openai-chat")
        bodies = list(server.bodies)
    capsys.readouterr()
    # vLLM's file name: {label}-{rate}qps-concurrency{N}-{model}-{date}.json
    assert re.fullmatch(r"openai-infqps-concurrency4-fake-llm-\d{8}-\d{6}\.json", r["name"])
    assert VLLM_FIELDS | DETAILED | {"run"} <= set(r), sorted(VLLM_FIELDS - set(r))
    assert VLLM_FIELDS <= set(tight) and not DETAILED & set(tight)
    assert r["model_id"] == "fake-llm"        # no --model: the first the server lists
    assert (r["backend"], tight["backend"]) == ("openai", "openai-chat")
    assert r["request_rate"] == "inf" and r["max_concurrency"] == 4 and r["run"] == "ci"
    assert r["num_prompts"] == r["completed"] == 12 and r["failed"] == 0
    assert r["total_output_tokens"] == 12 * 6 == sum(r["output_lens"])
    assert r["total_input_tokens"] == sum(r["input_lens"]) and 12 * 24 == sum(r["input_lens"])
    assert r["output_throughput"] == pytest.approx(72 / r["duration"])
    # random ignores EOS, as in vLLM; every request streamed with usage asked for
    assert len(bodies) == 24 and all(b["ignore_eos"] for b in bodies)
    assert all("messages" in b for b in bodies[12:]) and all("prompt" in b for b in bodies[:12])
    # a closed loop of 4: never more in flight; 12 requests of ~0.15 s keep 4 busy
    assert r["max_concurrent_requests"] == 4
    assert r["generated_texts"][0] == " w0 w1 w2 w3 w4 w5"
    assert all(len(itl) == 5 for itl in r["itls"])
    expect_tpot = TOKEN * 1e3
    assert expect_tpot * 0.9 <= r["median_tpot_ms"] <= expect_tpot + 30
    assert expect_tpot * 0.9 <= r["median_itl_ms"] <= expect_tpot + 30
    assert FIRST * 1e3 <= r["median_ttft_ms"] <= FIRST * 1e3 + 150
    assert r["p99_e2el_ms"] >= r["median_e2el_ms"] >= FIRST * 1e3 + 5 * expect_tpot
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])   # loose SLO
    assert tight["request_goodput"] == 0.0                                  # TTFT SLO < delay
    assert png_size(png) == (1200, 700)
