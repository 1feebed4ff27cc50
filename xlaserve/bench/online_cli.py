"""`xlaserve bench online`'s arguments: ours, and `vllm bench serve`'s where they mean the
same (`--request-rate` = `--rates`, `--num-prompts` = `--num-requests`, `--backend
openai|openai-chat` = `--endpoint completions|chat`, `--disable-tqdm` = `--no-progress`), plus
vLLM's datasets, `--goodput` and `--save-result`.  Imports nothing heavy until it runs."""

from __future__ import annotations

import argparse

_BACKENDS = {"openai": "completions", "openai-chat": "chat"}


def first_model(base_url: str, api_key: str | None, timeout_s: float) -> str:
    """The first model `GET {base_url}/models` lists (vLLM's default for no --model)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=timeout_s)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"--model not given and {base_url}/models names none: {e!r}") from None


def _metadata(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for item in pairs or ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _dataset(args: argparse.Namespace):  # -> DatasetOptions | None
    from xlaserve.bench.datasets import DatasetOptions

    if args.dataset is None:
        return None
    out_len = args.output_len
    lengths = {k: v for k, v in {
        "random_input_len": args.input_len or args.random_input_len,
        "random_output_len": out_len or args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "random_prefix_len": args.random_prefix_len,
        "sharegpt_output_len": out_len or args.sharegpt_output_len,
        "prefix_repetition_prefix_len": args.prefix_repetition_prefix_len,
        "prefix_repetition_suffix_len": args.prefix_repetition_suffix_len,
        "prefix_repetition_num_prefixes": args.prefix_repetition_num_prefixes,
        "prefix_repetition_output_len": out_len or args.prefix_repetition_output_len,
    }.items() if v is not None}
    return DatasetOptions(name=args.dataset, **lengths)


def run_online(args: argparse.Namespace) -> int:
    from xlaserve.bench.datasets import IGNORES_EOS
    from xlaserve.bench.online import OnlineOptions, online_main, parse_rates
    from xlaserve.bench.online_report import SLO
    from xlaserve.bench.stream_client import Endpoint
    from xlaserve.bench.vllm_result import SaveOptions

    dataset = _dataset(args)
    kind = _BACKENDS[args.backend] if args.backend else args.endpoint
    model = args.model or first_model(args.url, args.api_key, args.timeout)
    endpoint = Endpoint(base_url=args.url, model=model, kind=kind, api_key=args.api_key,
                        include_usage=not args.no_usage, timeout_s=args.timeout,
                        ignore_eos=args.ignore_eos or (dataset is not None
                                                       and dataset.name in IGNORES_EOS))
    slo = SLO.from_goodput(args.goodput) if args.goodput else SLO(args.slo_ttft, args.slo_tpot)
    options = OnlineOptions(
        workload=args.workload, rates=parse_rates(args.rates), num_requests=args.num_requests,
        duration_s=args.duration, seed=args.seed, slo=slo, progress=not args.no_progress,
        max_concurrency=args.max_concurrency, dataset=dataset, goodput_set=bool(args.goodput))
    save = None
    if args.save_result:
        save = SaveOptions(
            result_dir=args.result_dir, result_filename=args.result_filename, label=args.label,
            detailed=args.save_detailed, metadata=_metadata(args.metadata),
            percentile_metrics=tuple(m for m in args.percentile_metrics.split(",") if m),
            metric_percentiles=tuple(float(q) for q in args.metric_percentiles.split(",")
                                     if q.strip()))
    return online_main(endpoint, options, args.tokenizer, args.json, args.plot, save)


def _add_dataset_args(n: argparse.ArgumentParser) -> None:
    from xlaserve.bench.datasets import DATASETS

    d = n.add_argument_group("datasets (vLLM's shapes; defaults are vLLM's)")
    d.add_argument("--dataset", "--dataset-name", dest="dataset", default=None,
                   help=f"{' | '.join(DATASETS)} (prefix_repetition also accepted); "
                   "instead of --workload")
    d.add_argument("--input-len", type=int, help="= --random-input-len")
    d.add_argument("--output-len", type=int, help="every dataset's output length")
    d.add_argument("--random-input-len", type=int, help="default 1024")
    d.add_argument("--random-output-len", type=int, help="default 128")
    d.add_argument("--random-range-ratio", type=float,
                   help="lengths uniform in [len*(1-r), len*(1+r)]; default 0")
    d.add_argument("--random-prefix-len", type=int,
                   help="tokens of one prefix every random prompt starts with; default 0")
    d.add_argument("--sharegpt-output-len", type=int,
                   help="fix every sharegpt-like output length (default: drawn)")
    d.add_argument("--prefix-repetition-prefix-len", type=int, help="default 256")
    d.add_argument("--prefix-repetition-suffix-len", type=int, help="default 256")
    d.add_argument("--prefix-repetition-num-prefixes", type=int, help="default 10")
    d.add_argument("--prefix-repetition-output-len", type=int, help="default 128")


def _add_result_args(n: argparse.ArgumentParser) -> None:
    r = n.add_argument_group("vLLM result files (--save-result)")
    r.add_argument("--save-result", action="store_true",
                   help="write each rate's result as `vllm bench serve --save-result` does")
    r.add_argument("--save-detailed", action="store_true",
                   help="with per-request input_lens, output_lens, ttfts, itls, start_times, "
                   "generated_texts")
    r.add_argument("--result-dir", help="folder of the result files (default: .)")
    r.add_argument("--result-filename",
                   help="file name (one rate only; default {label}-{rate}qps"
                   "[-concurrency{N}]-{model}-{date}.json)")
    r.add_argument("--label", help="result label (default: the backend name)")
    r.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="added to the result")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics with statistics in the result (ttft,tpot,itl,e2el,"
                   "client_queue_time)")
    r.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles (default 99)")


def add_online_parser(bsub: argparse._SubParsersAction) -> None:
    from xlaserve.bench.workload import WORKLOADS

    n = bsub.add_parser("online", help="Poisson arrivals at one or more rates against an "
                        "OpenAI-compatible server: TTFT, TPOT, ITL, latency, goodput "
                        "(vLLM's `bench serve` flags understood)")
    n.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    n.add_argument("--model", help="the served model's name (default: the first the "
                   "server's /models lists)")
    n.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    n.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    n.add_argument("--backend", choices=sorted(_BACKENDS),
                   help="vLLM's name for --endpoint: openai = completions, openai-chat = chat")
    n.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS),
                   help="; ".join(f"{k}: {v.description}" for k, v in WORKLOADS.items()))
    n.add_argument("--tokenizer", help="model folder whose tokenizer.json cuts the prompts "
                   "to exact token lengths (default: the corpus cut into words)")
    n.add_argument("--rates", "--request-rate", dest="rates", default="1",
                   help="requests/s, comma-separated for a sweep (e.g. 0.5,1,2); inf sends "
                   "every request at once")
    n.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int,
                   default=None, help="requests per rate (default: the workload's count; "
                   "1000 for a --dataset, as vLLM)")
    n.add_argument("--duration", type=float, default=None,
                   help="seconds per rate after which no request is sent")
    n.add_argument("--max-concurrency", type=int, default=None,
                   help="at most N requests in flight (with --rates inf: a closed loop at "
                   "fixed concurrency, as `vllm bench serve --max-concurrency`)")
    n.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly max_tokens per request (ignore_eos: vLLM's and "
                   "llama.cpp's extension), so every server generates the same tokens; "
                   "always on for --dataset random, as in vLLM")
    n.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s")
    n.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT, s")
    n.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO on TPOT, s")
    n.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="vLLM's goodput SLOs in ms (ttft, tpot, e2el), e.g. --goodput "
                   "ttft:500 tpot:50; replaces --slo-ttft/--slo-tpot")
    n.add_argument("--no-usage", action="store_true",
                   help="do not ask for stream_options.include_usage (count text chunks)")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--json", help="write summaries and per-request records")
    n.add_argument("--plot", help="write a PNG: TTFT/TPOT/ITL p50 and p99 against rate, "
                   "and their distributions (CDF) at each rate")
    n.add_argument("--no-progress", "--disable-tqdm", dest="no_progress",
                   action="store_true", help="no progress bar")
    _add_dataset_args(n)
    _add_result_args(n)
    n.set_defaults(fn=run_online)
