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
        copy_bytes=args.copy_mib << 20)
    return offline_main(args.model, options, args.json)


def _startup(args: argparse.Namespace) -> int:
    from xlaserve.bench.startup import startup_main

    return startup_main(args.model, args.variant_layers, args.chunk, args.width, args.json)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from xlaserve.bench.workload import WORKLOADS

    b = sub.add_parser("bench", help="benchmarks: offline throughput, startup")
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
    o.set_defaults(fn=_offline)

    s = bsub.add_parser("startup", help="load + compile time of the model vs a shallow variant")
    s.add_argument("--model", required=True, help="model folder written by `xlaserve convert`")
    s.add_argument("--variant-layers", type=int, default=2)
    s.add_argument("--chunk", type=int, default=128, help="prefill bucket tokens")
    s.add_argument("--width", type=int, default=16, help="block-table width of both buckets")
    s.add_argument("--json", help="write the rows as JSON")
    s.set_defaults(fn=_startup)
