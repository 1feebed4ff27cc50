"""The prefill/decode split's handoff gap (BENCHMARKS.md "Prefill/decode split"): against a
running `xlaserve serve` whose model is served by prefill and decode workers, one warm-up and
then `--requests` streamed greedy completions of distinct `--tokens`-token prompts (slices of
xlaserve's own source), each timing the gap between its first token (the prefill worker's
finish) and its second (the decode worker's first step, after the KV handoff), and its time
to first token; prints each, their medians, and the server's KV transfer counters.

    python -m xlaserve.bench.split_gap --url http://127.0.0.1:8000 --model smollm2 \\
        --tokenizer .models/smollm2-135m-instruct [--tokens 1024] [--requests 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from xlaserve.serving.tokenizer import Tokenizer


def token_times(url: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """When each generated token arrived (time.monotonic()), the request sent at [0]."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    times = [time.monotonic()]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            lp = chunk["choices"][0].get("logprobs") or {}
            times += [time.monotonic()] * len(lp.get("tokens") or [])
    if len(times) < 3:
        raise RuntimeError(f"{url}: {len(times) - 1} tokens streamed, need 2 for a gap")
    return times


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokenizer", type=Path, default=Path(".models/smollm2-135m-instruct"))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=6)
    args = ap.parse_args(argv)
    source = Path(__file__).parents[1] / "serving"
    text = " ".join(p.read_text() for p in sorted(source.rglob("*.py")))
    ids = Tokenizer.load(args.tokenizer).encode(text)
    stride = args.tokens + 64    # no two prompts share a leading block
    if len(ids) < (args.requests + 1) * stride:
        raise ValueError(f"{len(ids)} tokens of source text: too few for {args.requests + 1} "
                         f"prompts of {args.tokens}")
    gaps, ttfts = [], []
    for i in range(args.requests + 1):      # request 0 warms up (gather/scatter compiles)
        t = token_times(args.url, args.model, ids[i * stride:i * stride + args.tokens], 4)
        if i:
            gaps.append(t[2] - t[1])
            ttfts.append(t[1] - t[0])
            print(f"request {i}: TTFT {ttfts[-1] * 1e3:.0f} ms, first->second token "
                  f"{gaps[-1] * 1e3:.0f} ms", flush=True)
    m = httpx.get(args.url + "/metrics", timeout=10).text
    print(f"median over {args.requests}: first->second token "
          f"{statistics.median(gaps) * 1e3:.0f} ms, TTFT {statistics.median(ttfts) * 1e3:.0f} "
          f"ms; KV transfers (warm-up included): "
          f"{metric(m, 'xlaserve_kv_transfer_seconds_count'):.0f}, "
          f"{metric(m, 'xlaserve_kv_transfer_seconds_sum'):.3f} s, "
          f"{metric(m, 'xlaserve_kv_transfer_bytes_total') / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
