"""The `xlaserve bench` subcommands' arguments (imports nothing heavy until one runs)."""

from __future__ import annotations

import argparse

from xlaserve.models.quantize import KV_DTYPES


def _offline(args: argparse.Namespace) -> int:
    from xlaserve.bench.offline import OfflineOptions, offline_main

    options = OfflineOptions(
        workload=args.workload, systems=tuple(s.strip() for s in args.systems.split(",")
                                              if s.strip()),
        batch=args.batch, seed=args.seed, num_requests=args.num_requests, gguf=args.gguf,
        hf_dir=args.hf_dir, decode_steps=args.decode_steps,
        copy_bytes=args.copy_mib << 20, breakdown=args.breakdown,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    return offline_main(args.model, options, args.json)


def _startup(args: argparse.Namespace) -> int:
    from xlaserve.bench.startup import startup_main

    return startup_main(args.model, args.variant_layers, args.chunk, args.width, args.json)


def _spec(args: argparse.Namespace) -> int:
    from xlaserve.bench.speculative import spec_main
    from xlaserve.serving.speculative import SpeculativeConfig

    if args.method == "draft":
        spec = SpeculativeConfig(method="draft", num_speculative_tokens=args.k,
                                 draft_model=args.draft_model, draft_layers=args.draft_layers)
    else:
        spec = SpeculativeConfig(num_speculative_tokens=args.k,
                                 prompt_lookup_max=args.ngram_max,
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
                     json_out=args.json, quantization=args.quantization,
                     kv_cache_dtype=args.kv_cache_dtype)


def _quality(args: argparse.Namespace) -> int:
    from xlaserve.bench.quality import quality_main

    quantization = None if args.quantization == "none" else args.quantization
    return quality_main(args.model, quantization, args.window, args.max_tokens,
                        args.backend, args.json, args.kv_cache_dtype)


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
    from xlaserve.bench.online_cli import add_online_parser

    b = sub.add_parser("bench", help="benchmarks: offline throughput, online serving, startup")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    _add_offline(bsub)
    add_online_parser(bsub)
    for add in (_add_step, _add_quality, _add_startup, _add_spec, _add_layouts):
        add(bsub)


def _add_offline(bsub: argparse._SubParsersAction) -> None:
    """`bench offline`."""
    from xlaserve.bench.workload import WORKLOADS

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
    o.add_argument("--quantization", choices=["int8", "fp8"], default=None,
                   help="int8 weights (a float folder is quantized as it loads)")
    o.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default=None,
                   help="the KV cache's dtype (default: the model's)")
    o.set_defaults(fn=_offline)


def _add_step(bsub: argparse._SubParsersAction) -> None:
    """`bench step`."""
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
    st.add_argument("--quantization", choices=["int8", "fp8"], default=None,
                    help="serve the weights int8 (a float folder is quantized as it loads)")
    st.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default=None,
                    help="the KV cache's dtype (default: the model's; int8 and fp8 are rows "
                         "with their scales)")
    st.add_argument("--breakdown", action="store_true",
                    help="also time each part of every step alone (weights, attention, head, "
                         "sampler, host)")
    st.add_argument("--json", help="write the report as JSON")
    st.set_defaults(fn=_step)


def _add_quality(bsub: argparse._SubParsersAction) -> None:
    """`bench quality`."""
    q = bsub.add_parser("quality", help="a quantized model against its float32 original: "
                        "perplexity, top-1 agreement, logit error, greedy chat agreement")
    q.add_argument("--model", required=True, help="float model folder written by `xlaserve "
                   "convert` (quantized as it loads)")
    q.add_argument("--quantization", default="int8", choices=["int8", "fp8", "none"],
                   help="weights (none: float32 weights, to measure the KV cache alone)")
    q.add_argument("--kv-cache-dtype", choices=["int8", "fp8"], default=None,
                   help="also run the quantized side on an int8 (or fp8) KV cache")
    q.add_argument("--window", type=int, default=256, help="tokens per teacher-forced window")
    q.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per chat answer")
    q.add_argument("--backend", default="auto", help="attention backend (see kernels/)")
    q.add_argument("--json", help="write the report as JSON")
    q.set_defaults(fn=_quality)


def _add_startup(bsub: argparse._SubParsersAction) -> None:
    """`bench startup`."""
    s = bsub.add_parser("startup", help="load + compile time of the model vs a shallow variant")
    s.add_argument("--model", required=True, help="model folder written by `xlaserve convert`")
    s.add_argument("--variant-layers", type=int, default=2)
    s.add_argument("--chunk", type=int, default=128, help="prefill bucket tokens")
    s.add_argument("--width", type=int, default=16, help="block-table width of both buckets")
    s.add_argument("--json", help="write the rows as JSON")
    s.set_defaults(fn=_startup)


def _add_spec(bsub: argparse._SubParsersAction) -> None:
    """`bench spec`."""
    sp = bsub.add_parser("spec", help="a workload without and with speculation (n-gram or "
                         "draft model), interleaved: single-stream TPOT or batch throughput")
    sp.add_argument("--model", required=True, help="model folder written by `xlaserve convert`")
    sp.add_argument("--workload", default="lookup", help="a named workload (default lookup)")
    sp.add_argument("--mode", default="single", choices=("single", "batch"))
    sp.add_argument("--rounds", type=int, default=2, help="passes per system, interleaved")
    sp.add_argument("--num-requests", type=int, default=None)
    sp.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    sp.add_argument("--ngram-max", type=int, default=4, help="prompt_lookup_max")
    sp.add_argument("--ngram-min", type=int, default=2, help="prompt_lookup_min")
    sp.add_argument("--method", default="ngram", choices=("ngram", "draft"))
    sp.add_argument("--draft-model", default=None, help="method draft: the draft's folder")
    sp.add_argument("--draft-layers", type=int, default=None,
                    help="method draft: the draft's (or the model's own) first N layers")
    sp.add_argument("--json", default=None, help="write every figure here")
    sp.set_defaults(fn=_spec)


def _add_layouts(bsub: argparse._SubParsersAction) -> None:
    """`bench layouts`."""
    lay = bsub.add_parser("layouts", help="per-device parameter and KV bytes on mesh layouts")
    lay.add_argument("--model", required=True, help="model folder (only its config is read)")
    lay.add_argument("--meshes", default="configs/tp2.toml,configs/tp3.toml,configs/pp2.toml,"
                     "configs/tp2_pp2.toml,configs/tp3_pp2.toml,configs/2x_tp2.toml,"
                     "configs/ep2.toml,configs/ep4.toml,configs/ep2_tp2.toml,configs/ep2_pp2.toml",
                     help="comma-separated mesh presets (one device is always listed first; "
                     "the ep* presets fit mixture-of-experts models only)")
    lay.add_argument("--num-blocks", type=int, default=2048)
    lay.add_argument("--block-size", type=int, default=16)
    lay.set_defaults(fn=_layouts)
