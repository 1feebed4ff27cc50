"""The `xlaserve bench` subcommands' arguments (imports nothing heavy until one runs)."""

from __future__ import annotations

import argparse


def _offline(args: argparse.Namespace) -> int:
    from xlaserve.bench.offline import OfflineOptions, offline_main

    options = OfflineOptions(
        workload=args.workload, systems=tuple(s.strip() for s in args.systems.split(",")
                                              if s.strip()),
        batch=args.batch, seed=args.seed, num_requests=args.num_requests, gguf=args.gguf,
        hf_dir=args.hf_dir, decode_steps=args.decode_steps,
        copy_bytes=args.copy_mib << 20, breakdown=args.breakdown)
    return offline_main(args.model, options, args.json)


def _startup(args: argparse.Namespace) -> int:
    from xlaserve.bench.startup import startup_main

    return startup_main(args.model, args.variant_layers, args.chunk, args.width, args.json)


def _online(args: argparse.Namespace) -> int:
    from xlaserve.bench.online import OnlineOptions, online_main, parse_rates
    from xlaserve.bench.online_report import SLO
    from xlaserve.bench.stream_client import Endpoint

    endpoint = Endpoint(base_url=args.url, model=args.model, kind=args.endpoint,
                        api_key=args.api_key, include_usage=not args.no_usage,
                        timeout_s=args.timeout, ignore_eos=args.ignore_eos)
    options = OnlineOptions(
        workload=args.workload, rates=parse_rates(args.rates), num_requests=args.num_requests,
        duration_s=args.duration, seed=args.seed, slo=SLO(args.slo_ttft, args.slo_tpot),
        progress=not args.no_progress, max_concurrency=args.max_concurrency)
    return online_main(endpoint, options, args.tokenizer, args.json, args.plot)


def _spec(args: argparse.Namespace) -> int:
    from xlaserve.bench.speculative import spec_main
    from xlaserve.serving.speculative import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=args.ngram_max,
                             prompt_lookup_min=args.ngram_min)
    return spec_main(args.model, args.workload, args.mode, args.rounds, spec,
                     args.num_requests, args.json)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _step(args: argparse.Namespace) -> int:
    from xlaserve.bench.step import step_main

    return step_main(args.model, decode_batches=_ints(args.rows), width=args.width,
                     context=args.context, prefill_chunks=_ints(args.chunks),
                     repeats=args.repeats, breakdown=args.breakdown, backend=args.backend,
                     json_out=args.json)


def _layouts(args: argparse.Namespace) -> int:
    from xlaserve.checkpoints.store import load_config
    from xlaserve.sharding.memory import format_layout_report, layout_report
    from xlaserve.sharding.mesh import MeshConfig

    config = load_config(args.model)
    rows, refused = [], []
    for path in ["", *[p for p in args.meshes.split(",") if p]]:
        mesh = MeshConfig.load(path) if path else MeshConfig()
        try:
            rows += layout_report(config, [mesh], args.num_blocks, args.block_size)
        except ValueError as e:
            refused.append(f"{path}: {e}")
    print(f"{config.num_params / 1e6:.1f}M parameters ({config.dtype}), KV pool of "
          f"{args.num_blocks} blocks x {args.block_size} tokens; bytes per device:")
    print(format_layout_report(rows))
    for line in refused:
        print(f"refused {line}")
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from xlaserve.bench.workload import WORKLOADS

    b = sub.add_parser("bench", help="benchmarks: offline throughput, online serving, startup")
    bsub = b.add_subparsers(dest="bench_command", required=True)

    o = bsub.add_parser("offline", help="one workload through engine / static / hf, one table")
    o.add_argument("--model", required=True, help="model folder written by `xlaserve convert`")
    o.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS),
                   help="; ".join(f"{k}: {v.description}" for k, v in WORKLOADS.items()))
    o.add_argument("--systems", default="engine,static,hf",
                   help="comma-separated subset of engine,static,hf")
    o.add_argument("--batch", type=int, default=8, help="static and hf batch size")
    o.add_argument("--gguf", help="GGUF file of the same model, for hf")
    o.add_argument("--hf-dir", help="HF folder (config.json + safetensors), for hf")
    o.add_argument("--json", help="write the full report (per-request tokens included)")
    o.add_argument("--num-requests", type=int, default=None,
                   help="override the workload's request count")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--decode-steps", type=int, default=20,
                   help="batch-1 decode steps timed for the bandwidth comparison")
    o.add_argument("--copy-mib", type=int, default=512,
                   help="array size of the bandwidth probe, MiB")
    o.add_argument("--breakdown", action="store_true",
                   help="rerun engine and static timing every device call per bucket "
                   "(calls waited for: not the headline numbers)")
    o.set_defaults(fn=_offline)

    n = bsub.add_parser("online", help="Poisson arrivals at one or more rates against an "
                        "OpenAI-compatible server: TTFT, TPOT, ITL, latency, goodput")
    n.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    n.add_argument("--model", required=True, help="the served model's name")
    n.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    n.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    n.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS),
                   help="; ".join(f"{k}: {v.description}" for k, v in WORKLOADS.items()))
    n.add_argument("--tokenizer", help="model folder whose tokenizer.json cuts the prompts "
                   "to exact token lengths (default: the corpus cut into words)")
    n.add_argument("--rates", default="1", help="requests/s, comma-separated for a sweep "
                   "(e.g. 0.5,1,2); inf sends every request at once")
    n.add_argument("--num-requests", type=int, default=None,
                   help="requests per rate (default: the workload's count)")
    n.add_argument("--duration", type=float, default=None,
                   help="seconds per rate after which no request is sent")
    n.add_argument("--max-concurrency", type=int, default=None,
                   help="at most N requests in flight (with --rates inf: a closed loop at "
                   "fixed concurrency, as `vllm bench serve --max-concurrency`)")
    n.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly max_tokens per request (ignore_eos: vLLM's and "
                   "llama.cpp's extension), so every server generates the same tokens")
    n.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s")
    n.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT, s")
    n.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO on TPOT, s")
    n.add_argument("--no-usage", action="store_true",
                   help="do not ask for stream_options.include_usage (count text chunks)")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--json", help="write summaries and per-request records")
    n.add_argument("--plot", help="write a PNG of TTFT/TPOT p50 and p99 against rate")
    n.add_argument("--no-progress", action="store_true", help="no progress bar")
    n.set_defaults(fn=_online)

    st = bsub.add_parser("step", help="each kind of device step timed against its floor "
                         "(read bandwidth and GEMM rate measured in the same run)")
    st.add_argument("--model", required=True, help="model folder written by `xlaserve convert`")
    st.add_argument("--rows", default="1,8,16,32", help="decode batch sizes")
    st.add_argument("--width", type=int, default=48, help="block-table width of decode rows")
    st.add_argument("--context", type=int, default=700,
                    help="cached tokens per decode row (attention reads them)")
    st.add_argument("--chunks", default="64,128,256,512", help="prefill chunk lengths")
    st.add_argument("--repeats", type=int, default=10)
    st.add_argument("--backend", default="auto", help="attention backend (see kernels/)")
    st.add_argument("--breakdown", action="store_true",
                    help="also time each part of every step alone (weights, attention, head, "
                         "sampler, host)")
    st.add_argument("--json", help="write the report as JSON")
    st.set_defaults(fn=_step)

    s = bsub.add_parser("startup", help="load + compile time of the model vs a shallow variant")
    s.add_argument("--model", required=True, help="model folder written by `xlaserve convert`")
    s.add_argument("--variant-layers", type=int, default=2)
    s.add_argument("--chunk", type=int, default=128, help="prefill bucket tokens")
    s.add_argument("--width", type=int, default=16, help="block-table width of both buckets")
    s.add_argument("--json", help="write the rows as JSON")
    s.set_defaults(fn=_startup)

    sp = bsub.add_parser("spec", help="a workload without and with n-gram speculation, "
                         "interleaved: single-stream TPOT or batch throughput")
    sp.add_argument("--model", required=True, help="model folder written by `xlaserve convert`")
    sp.add_argument("--workload", default="lookup", help="a named workload (default lookup)")
    sp.add_argument("--mode", default="single", choices=("single", "batch"))
    sp.add_argument("--rounds", type=int, default=2, help="passes per system, interleaved")
    sp.add_argument("--num-requests", type=int, default=None)
    sp.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    sp.add_argument("--ngram-max", type=int, default=4, help="prompt_lookup_max")
    sp.add_argument("--ngram-min", type=int, default=2, help="prompt_lookup_min")
    sp.add_argument("--json", default=None, help="write every figure here")
    sp.set_defaults(fn=_spec)

    lay = bsub.add_parser("layouts", help="per-device parameter and KV bytes on mesh layouts")
    lay.add_argument("--model", required=True, help="model folder (only its config is read)")
    lay.add_argument("--meshes", default="configs/tp2.toml,configs/tp3.toml,configs/pp2.toml,"
                     "configs/tp2_pp2.toml,configs/tp3_pp2.toml,configs/2x_tp2.toml",
                     help="comma-separated mesh presets (one device is always listed first)")
    lay.add_argument("--num-blocks", type=int, default=2048)
    lay.add_argument("--block-size", type=int, default=16)
    lay.set_defaults(fn=_layouts)
